"""The recipe's schema: one pydantic model per section, unknown keys forbidden, the allowed
values and per-method defaults taken from quant/registry.py (recipe.py loads a file into it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, NoReturn

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kiln.compiler.trtllm.targets import PROFILES
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
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.strict import StrictModel


class ModelSection(StrictModel):
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
    """Raise a problem with the section's `key` (none: the value's own) as a schema error
    (see _format_error)."""
    raise PydanticCustomError(
        "kiln_rule", "{problem}", {"key": key, "problem": problem, "fix": fix}
    )


def _known_target(name: str) -> str:
    """A GPU target name kiln has a profile for. Checked with the schema, so a recipe with
    other schema problems still hears about its targets."""
    if name not in PROFILES:
        _refuse("", f"unknown GPU target {name!r}", "known targets: " + ", ".join(sorted(PROFILES)))
    return name


TargetName = Annotated[str, AfterValidator(_known_target)]


def _or(values: tuple[int, ...]) -> str:
    """`128, 64 or 32`."""
    *head, last = map(str, values)
    return f"{', '.join(head)} or {last}" if head else last


class QuantizationSection(StrictModel):
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

    @field_validator("ignore")
    @classmethod
    def _ignore_entries(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            if not entry.strip():
                raise ValueError("an empty entry ignores nothing; name a module, or re:PATTERN")
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as exc:
                    raise ValueError(
                        f"{entry!r} is not a valid regular expression ({exc})"
                    ) from None
        return entries

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


class CalibrationSection(StrictModel):
    dataset: str = "builtin:shakespeare"
    num_samples: int = Field(64, ge=1, le=4096)
    max_seq_len: int = Field(256, ge=16, le=32768)
    seed: int = 0
    text_field: str = "text"
    # Mixture of experts (quant/moe_routing.py): calibrate every expert on every token (all),
    # or only on the tokens routed to it, reporting (warn) or refusing (fail) experts routed
    # fewer than moe_min_tokens.
    moe_experts: Literal["all", "warn", "fail"] = "all"
    moe_min_tokens: int = Field(16, ge=0)


class ReportSection(StrictModel):
    dataset: str = "builtin:licenses"
    num_samples: int = Field(16, ge=1, le=1024)
    max_seq_len: int = Field(256, ge=16, le=32768)


class DeploySection(StrictModel):
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


class DraftSection(StrictModel):
    """The draft model of draft-target speculation: a model source and its own quantisation."""

    source: str = Field(description="same syntax as model.source")
    quantization: QuantizationSection = QuantizationSection()  # default: keep it float


class SpeculativeSection(StrictModel):
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


class SearchSection(StrictModel):
    """What `kiln search` tries (its command-line options override these)."""

    targets: list[str] = Field(default_factory=list)  # empty: the recipe's targets
    schemes: list[str] | None = None  # None: every scheme the targets run
    kv_cache: list[str] = Field(default_factory=lambda: ["none", "fp8"])  # none | fp8
    mixed: bool = True  # mixed precision from the measured per-layer sensitivity
    early_stop: bool = True  # gate a quarter of the task items first
    measure: bool = True  # kiln's runtime decode speed on the searching machine
    budget_hours: float | None = Field(None, gt=0)
    max_candidates: int | None = Field(None, ge=1)


class RecipeModel(StrictModel):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")
    model: ModelSection
    quantization: QuantizationSection = QuantizationSection()
    calibration: CalibrationSection = CalibrationSection()
    report: ReportSection = ReportSection()
    targets: list[TargetName] = Field(default_factory=list)
    deploy: DeploySection = DeploySection()
    output: str = Field("artifacts", min_length=1)
    gates: GatesSection | None = None  # what `kiln gate` measures and its thresholds
    speculative: SpeculativeSection | None = None  # a draft compiled beside the model
    search: SearchSection | None = None  # what `kiln search` tries

    @field_validator("output")
    @classmethod
    def _output_path(cls, value: str) -> str:
        if "\0" in value:
            raise ValueError("holds a NUL byte, which no path can; write a directory path")
        return value


def section_spec(q: QuantizationSection) -> QuantSpec:
    """A quantization section with its method's defaults filled in."""
    filled = METHODS[q.method].fill(
        q.weight_bits, q.group_size, q.symmetric, q.activations, q.backend
    )
    return QuantSpec(**{**q.model_dump(), **filled, "ignore": tuple(q.ignore)})
