"""The recipe: one YAML file describing a deployment, validated once at the edge.

Loading keeps the file and line of every key (also through `extends:` chains), so each
problem is reported as `file:line: key: problem — what is allowed`. The pydantic models
below forbid unknown keys; everything past this module works on plain dataclasses
(`quant.spec.QuantSpec`, `quant.spec.CalibrationSpec`, `compiler.planner.DeploySpec`).
"""

from __future__ import annotations

import copy
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kiln.compiler.recipe.reader import Key, Origins, read_yaml
from kiln.compiler.trtllm.capacity import DeploySpec
from kiln.gates.settings import GatesSection
from kiln.quant.backends import BACKENDS
from kiln.quant.registry import (
    ACTIVATIONS,
    FLOAT_BITS,
    GROUP_SIZES,
    KV_CACHE,
    METHODS,
    WEIGHT_BITS,
    group_size_problem,
    weight_bits_problem,
)
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import RecipeError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    source: str = Field(description="local HF dir, .gguf file, builtin:NAME or a hub id")


# The values the quantization keys take are the quantisation registry's (quant/registry.py);
# pydantic refuses any other and lists these.
if TYPE_CHECKING:
    MethodName = str
    ActivationMode = str
    KVCacheMode = str
    BackendName = str
    WeightBits = int
else:
    MethodName = Literal[tuple(METHODS)]
    ActivationMode = Literal[("default", *ACTIVATIONS)]
    KVCacheMode = Literal[tuple(KV_CACHE)]
    BackendName = Literal[tuple(BACKENDS)]
    WeightBits = Literal[WEIGHT_BITS]


def _refuse(key: str, problem: str, fix: str) -> NoReturn:
    """Raise a problem with the section's `key` as a schema error (see _format_error)."""
    raise PydanticCustomError(
        "kiln_rule", "{problem}", {"key": key, "problem": problem, "fix": fix}
    )


def _or(values: tuple[int, ...]) -> str:
    """`128, 64 or 32`."""
    *head, last = map(str, values)
    return f"{', '.join(head)} or {last}" if head else last


class QuantizationSection(_Strict):
    method: MethodName = "none"
    weight_bits: WeightBits | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    activations: ActivationMode = "default"
    kv_cache: KVCacheMode = "none"
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    backend: BackendName | None = None  # None: the method's (llmcompressor but for nvfp4)
    smoothing_strength: float = Field(0.8, gt=0.0, lt=1.0)
    dampening_frac: float = Field(0.01, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _registry_rules(self) -> QuantizationSection:
        """The group-size and weight-bits rules, as quant.schemes.check applies them."""
        group = group_size_problem(self.group_size)
        if group is not None:
            fix = f"use {_or(GROUP_SIZES)}, or leave it out for the method's default"
            _refuse("group_size", group.problem, fix)
        if METHODS[self.method].weight_bits == FLOAT_BITS:
            if self.weight_bits is not None or self.group_size is not None:
                _refuse("method", f"method {self.method} keeps float weights, so "
                        "weight_bits/group_size do not apply",
                        "set a method (gptq, awq, fp8, ...) or drop those keys")  # fmt: skip
        elif self.weight_bits is not None:
            bits = weight_bits_problem(self.method, self.weight_bits)
            if bits is not None:
                _refuse("weight_bits", bits.problem, f"use {bits.allowed}")
        return self


class CalibrationSection(_Strict):
    dataset: str = "builtin:shakespeare"
    num_samples: int = Field(64, ge=1, le=4096)
    max_seq_len: int = Field(256, ge=16, le=32768)
    seed: int = 0
    text_field: str = "text"


class ReportSection(_Strict):
    dataset: str = "builtin:licenses"
    num_samples: int = Field(16, ge=1, le=1024)
    max_seq_len: int = Field(256, ge=16, le=32768)


class DeploySection(_Strict):
    max_seq_len: int = Field(4096, ge=16)
    max_input_len: int | None = Field(None, ge=1)
    max_batch_size: int = Field(256, ge=1)
    max_num_tokens: int = Field(8192, ge=16)
    kv_free_fraction: float = Field(0.9, gt=0.0, le=1.0)
    tp_size: int | None = Field(None, ge=1, le=64)
    pp_size: int = Field(1, ge=1, le=64)
    tokens_per_block: int = Field(32, ge=1)
    gpu_price_per_hour: float | None = Field(None, gt=0)
    expected_output_tokens_per_s: float | None = Field(None, gt=0)
    # Which TensorRT-LLM path the artifact must serve: 1.2.x engines, the PyTorch backend, or both.
    trtllm_path: Literal["both", "engine", "pytorch"] = "both"


class DraftSection(_Strict):
    """The draft model of draft-target speculation: a model source and its own quantisation."""

    source: str = Field(description="same syntax as model.source")
    quantization: QuantizationSection = QuantizationSection()  # default: keep it float


class SpeculativeSection(_Strict):
    """`speculative:` — draft-target (or prompt-lookup n-gram) speculative decoding."""

    method: Literal["draft", "ngram"] = "draft"
    draft: DraftSection | None = None
    max_draft_len: int | Literal["auto"] = "auto"
    # What `auto` measures: prompts from the calibration data, tokens decoded per prompt,
    # and the largest K it may choose.
    auto_prompts: int = Field(8, ge=1, le=256)
    auto_max_tokens: int = Field(32, ge=4, le=1024)
    auto_max_k: int = Field(8, ge=1, le=16)
    max_matching_ngram_size: int = Field(3, ge=1, le=16)  # ngram: suffix length looked up
    # Speculation is served by trtllm-serve's speculative_config (PyTorch backend): TensorRT-
    # LLM 1.2 drives DraftTarget/NGram nowhere else. True also plans the 1.2.x engine for
    # externally drafted tokens (draft_tokens_external + a draft engine), which speculates
    # only under a C++ Executor API client that supplies the draft tokens itself.
    external_draft_engine: bool = False

    @field_validator("draft", mode="before")
    @classmethod
    def _draft_shorthand(cls, value: Any) -> Any:
        # `draft: path` is short for `draft: {source: path}`, like a bare model source.
        return {"source": value} if isinstance(value, str) else value

    @field_validator("max_draft_len")
    @classmethod
    def _draft_len(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 16:
            raise ValueError("must be auto or a number of draft tokens from 1 to 16 (4 to 8 usual)")
        return value


class RecipeModel(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    model: ModelSection
    quantization: QuantizationSection = QuantizationSection()
    calibration: CalibrationSection = CalibrationSection()
    report: ReportSection = ReportSection()
    targets: list[str] = Field(default_factory=list)
    deploy: DeploySection = DeploySection()
    output: str = "artifacts"
    gates: GatesSection | None = None  # what `kiln gate` measures and its thresholds
    speculative: SpeculativeSection | None = None  # a draft compiled beside the model


@dataclass
class Recipe:
    """A loaded, schema-valid recipe with the origin (file, line) of every key."""

    path: Path
    config: RecipeModel
    raw: dict[str, Any]
    origins: Origins = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)  # the recipe and every file it extends

    @property
    def name(self) -> str:
        return self.config.name

    def where(self, key: str | Key) -> str:
        """`file:line` of a dotted key, falling back to its closest defined parent."""
        parts: Key = tuple(key.split(".")) if isinstance(key, str) else key
        while parts:
            if parts in self.origins:
                file, line = self.origins[parts]
                return f"{file}:{line}"
            parts = parts[:-1]
        return f"{self.path}:1"

    def base_dir(self, key: str) -> Path:
        """Directory that relative paths under `key` resolve against: the file that set it."""
        parts = tuple(key.split("."))
        while parts:
            if parts in self.origins:
                return self.origins[parts][0].parent
            parts = parts[:-1]
        return self.path.parent

    def problem(self, key: str, problem: str, allowed: str = "") -> str:
        """Format one problem line the way `kiln validate` prints it."""
        tail = f" — {allowed}" if allowed else ""
        return f"{self.where(key)}: {key}: {problem}{tail}"

    def quant_spec(self) -> QuantSpec:
        """The quantization section with per-method defaults filled in."""
        return section_spec(self.config.quantization)

    def draft_quant_spec(self) -> QuantSpec | None:
        """The speculative draft's own quantization, defaulted; None without a draft."""
        spec = self.config.speculative
        if spec is None or spec.draft is None:
            return None
        return section_spec(spec.draft.quantization)

    def calibration_spec(self) -> CalibrationSpec:
        return self._text_spec("calibration")

    def report_spec(self) -> CalibrationSpec:
        return self._text_spec("report")

    def _text_spec(self, key: str) -> CalibrationSpec:
        """A section that names a text dataset, with its path resolved against its file."""
        section = getattr(self.config, key)
        return CalibrationSpec(
            **section.model_dump(), base_dir=str(self.base_dir(f"{key}.dataset"))
        )

    def deploy_spec(self) -> DeploySpec:
        return DeploySpec(**self.config.deploy.model_dump(exclude={"trtllm_path"}))

    def output_dir(self) -> Path:
        out = Path(self.config.output)
        return out if out.is_absolute() else (self.base_dir("output") / out).resolve()

    def resolved(self) -> dict[str, Any]:
        """The fully defaulted recipe as JSON-able data (what the manifest records)."""
        data = self.config.model_dump(mode="json")
        if data.get("speculative") is None:
            data.pop("speculative", None)  # a recipe without one resolves as it always did
        pairs = [(data["quantization"], self.quant_spec())]
        draft_spec = self.draft_quant_spec()
        if draft_spec is not None:
            pairs.append((data["speculative"]["draft"]["quantization"], draft_spec))
        for section, spec in pairs:
            section.update(
                weight_bits=spec.weight_bits,
                group_size=spec.group_size,
                symmetric=spec.symmetric,
                activations=spec.activations,
            )
        return data


def section_spec(q: QuantizationSection) -> QuantSpec:
    """A quantization section with its method's defaults filled in."""
    filled = METHODS[q.method].fill(
        q.weight_bits, q.group_size, q.symmetric, q.activations, q.backend
    )
    return QuantSpec(**{**q.model_dump(), **filled, "ignore": tuple(q.ignore)})


# --- the extends chain -----------------------------------------------------------------

RECIPE_SUFFIXES = (".yaml", ".yml")
MAX_EXTENDS = 16  # files in one chain
MAX_PROBLEMS = 50  # lines one report prints; the rest are counted
MAX_INPUT_CHARS = 80  # of a bad value quoted back in a problem line


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _load_chain(
    path: Path, chain: list[Path], problems: list[str], via: str = ""
) -> tuple[dict[str, Any], Origins, list[Path]]:
    """A recipe merged over the files it extends; `via`: `file:line` of the `extends:` that
    named this file (empty for the recipe itself)."""
    path = path.resolve()
    if path in chain:
        cycle = " → ".join(str(p) for p in [*chain, path])
        raise RecipeError([f"{chain[-1]}: extends: cycle {cycle} — a recipe cannot extend itself"])
    if len(chain) >= MAX_EXTENDS:
        raise RecipeError([f"{via}: extends: more than {MAX_EXTENDS} files deep — "
                           "flatten the chain"])  # fmt: skip
    data, origins = read_yaml(path, problems)
    recipe_keys = {"extends", *RecipeModel.model_fields}
    if via and (not isinstance(data, dict) or not set(data) & recipe_keys):
        # Say nothing of what the file holds: `extends` must not become a way to print files.
        raise RecipeError([f"{via}: extends: {path} is not a kiln recipe (a YAML mapping of "
                           "recipe keys) — extend a recipe file"])  # fmt: skip
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"{path}:1: a recipe is a YAML mapping (key: value), not {type(data).__name__}"]
        )
    files = [path]
    parent = data.pop("extends", None)
    if parent is None:
        return data, origins, files
    line = origins.get(("extends",), (path, 1))[1]
    if not isinstance(parent, str):
        raise RecipeError(
            [f"{path}:{line}: extends: must be one file path — e.g. extends: base.yaml"]
        )
    base_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    if base_path.suffix.lower() not in RECIPE_SUFFIXES:
        raise RecipeError([f"{path}:{line}: extends: {parent!r} is not a recipe file "
                           "(.yaml or .yml) — extend a kiln recipe"])  # fmt: skip
    if not base_path.is_file():
        raise RecipeError(
            [
                f"{path}:{line}: extends: {parent!r} not found (looked for {base_path}) — "
                "give a path relative to this recipe"
            ]
        )
    base, base_origins, base_files = _load_chain(
        base_path, [*chain, path], problems, f"{path}:{line}"
    )
    # Where the child sets a non-mapping value, the base's whole subtree under it is replaced.
    replaced = [k for k in origins if not isinstance(_get(data, k), dict)]
    merged_origins = {
        k: v
        for k, v in base_origins.items()
        if not any(len(k) > len(r) and k[: len(r)] == r for r in replaced)
    }
    merged_origins.update({k: v for k, v in origins.items() if k != ("extends",)})
    return _merge(base, data), merged_origins, [path, *base_files]


def _get(data: Any, key: Key) -> Any:
    for part in key:
        in_dict = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and part < len(data)
        if in_dict or in_list:
            data = data[part]
        else:
            return None
    return data


def _allowed_keys(loc: Key) -> str:
    model: type[BaseModel] = RecipeModel
    for part in loc[:-1]:
        info = model.model_fields.get(str(part))
        annotation = info.annotation if info else None
        # `X | None` sections (gates, speculative, speculative.draft): look inside the union
        options = get_args(annotation) or (annotation,)
        models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            return ""
        model = models[0]
    return "allowed keys: " + ", ".join(model.model_fields)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring = 2, 4, 4, MAX_INPUT_CHARS


def _shown(value: Any) -> str:
    """A bad value as a problem line quotes it: its repr, cut short."""
    text = _SHORT.repr(value)
    return text if len(text) <= MAX_INPUT_CHARS else text[: MAX_INPUT_CHARS - 1] + "…"


def _format_error(error: Any) -> tuple[Key, str, str]:
    loc: Key = tuple(error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        return loc, "unknown key", _allowed_keys(loc)
    if kind == "missing":
        return loc, "required key is missing", "add it"
    message = str(error["msg"])
    if kind == "kiln_rule":  # a rule of the quantisation registry, raised by _refuse
        context = error["ctx"]
        return (*loc, context["key"]), context["problem"], context["fix"]
    if kind == "literal_error":
        allowed = message.replace("Input should be", "use")
        return loc, f"{_shown(error['input'])} is not allowed", allowed
    if kind == "value_error":
        return loc, f"{_shown(error['input'])}: {message.removeprefix('Value error, ')}", ""
    if kind == "string_pattern_mismatch":
        return (
            loc,
            f"{_shown(error['input'])} is not a valid name",
            ("lower-case letters, digits, '.', '_' and '-', starting with a letter or digit"),
        )
    return loc, f"{_shown(error.get('input'))}: {message}", ""


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe and its `extends` chain; raise RecipeError listing every schema problem."""
    path = Path(path)
    problems: list[str] = []
    data, origins, files = _load_chain(path, [], problems)
    recipe = Recipe(path=path.resolve(), config=None, raw=data, origins=origins, files=files)  # type: ignore[arg-type]
    try:
        recipe.config = RecipeModel.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            loc, problem, allowed = _format_error(error)
            dotted = ".".join(str(p) for p in loc) or "(top level)"
            problems.append(
                recipe.problem(dotted, problem, allowed) if loc else f"{recipe.path}:1: {problem}"
            )
    if not problems:
        problems.extend(_speculative_problems(recipe))
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems = [*problems[:MAX_PROBLEMS], f"... and {more} more; fix these first"]
    if problems:
        raise RecipeError(problems)
    return recipe


def _speculative_problems(recipe: Recipe) -> list[str]:
    """Consistency that the schema alone cannot express: which speculative methods need a draft."""
    problems: list[str] = []
    spec = recipe.config.speculative
    if spec is None:
        return problems
    if spec.method == "draft" and spec.draft is None:
        problems.append(recipe.problem(
            "speculative", "method draft needs a draft model",
            "add draft: <model source> (make one with `kiln draft TARGET`), "
            "or use method: ngram",
        ))  # fmt: skip
    if spec.method == "ngram" and spec.draft is not None:
        problems.append(recipe.problem(
            "speculative.draft", "method ngram drafts from the prompt itself, not a model",
            "drop speculative.draft, or use method: draft",
        ))  # fmt: skip
    if recipe.config.deploy.trtllm_path == "engine" and not spec.external_draft_engine:
        problems.append(recipe.problem(
            "speculative", "with deploy.trtllm_path engine nothing would speculate: TensorRT-LLM "
            "1.2's LLM API and trtllm-serve run DraftTarget and NGram on the PyTorch backend "
            "only, and serve an engine as plain decoding",
            "deploy.trtllm_path: both or pytorch (trtllm-serve.yaml's speculative_config), or "
            "speculative.external_draft_engine: true for a C++ Executor API client that passes "
            "its own draft tokens",
        ))  # fmt: skip
    if spec.method == "ngram" and spec.max_draft_len == "auto":
        problems.append(recipe.problem(
            "speculative.max_draft_len", "auto measures a draft model; ngram has none",
            "give a number of draft tokens, e.g. max_draft_len: 4",
        ))  # fmt: skip
    return problems
