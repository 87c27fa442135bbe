"""The recipe: one YAML file describing a deployment, validated once at the edge.

Loading keeps the file and line of every key (also through `extends:` chains), so each
problem is reported as `file:line: key: problem — what is allowed`. The schema's pydantic
models (schema.py) forbid unknown keys; everything past this module works on plain
dataclasses (`quant.spec.QuantSpec`, `quant.spec.CalibrationSpec`,
`compiler.trtllm.capacity.DeploySpec`).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.extends import load_chain
from kiln.compiler.recipe.reader import Key, Origins
from kiln.compiler.recipe.schema import RecipeModel, section_spec
from kiln.compiler.trtllm.capacity import DeploySpec
from kiln.quant.spec import CalibrationSpec, QuantSpec


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


MAX_PROBLEMS = 50  # lines one report prints; the rest are counted


MAX_INPUT_CHARS = 80  # of a bad value quoted back in a problem line


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


def _not_a_number(value: Any, kind: str) -> tuple[str, str] | None:
    """(problem, fix) where a number field holds text that reads as a number (a quoted one),
    or a whole float where an integer is required (`1e3` is a float, as in YAML 1.2)."""
    integer = kind == "int_type"
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        if not math.isfinite(number):
            return None
        plain = str(int(number)) if integer and number.is_integer() else repr(number)
        return f"{_shown(value)} is text, not a number (quoted?)", f"write it unquoted: {plain}"
    if integer and isinstance(value, float) and value.is_integer() and math.isfinite(value):
        problem = f"{value!r} is a float (a decimal point or an exponent makes one), not an integer"
        return problem, f"write {int(value)}"
    return None


def _format_error(error: Any) -> tuple[Key, str, str]:
    loc: Key = tuple(error["loc"])
    kind = error["type"]
    if kind in ("int_type", "float_type") and (hint := _not_a_number(error["input"], kind)):
        return loc, *hint
    if kind == "extra_forbidden":
        return loc, "unknown key", _allowed_keys(loc)
    if kind == "missing":
        return loc, "required key is missing", "add it"
    message = str(error["msg"])
    if kind == "kiln_rule":  # a rule of the quantisation registry, raised by _refuse
        context = error["ctx"]
        key = (context["key"],) if context["key"] else ()
        return (*loc, *key), context["problem"], context["fix"]
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
    data, origins, files = load_chain(path, [], problems)
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
