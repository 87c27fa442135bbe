"""The recipe's `gates:` section (also a standalone `--gate-file`), validated at the edge.

    gates:
      baseline: source                       # what `kiln compile` gates against (see below)
      tasks: [kiln_ppl, kiln_cloze, kiln_next_word]  # offline tasks (recipes/tasks) or lm-eval
      limit: null                            # items per task (null: all)
      decision_rule: mcnemar                 # or recovery, noninferior, recovery_or_noninferior
      inconclusive: pass                     # what a task too small for its margin counts as
      thresholds: {margin: 0.02, confidence: 0.95, kl_mean: 0.035, shadow_exact_match: 0.9}
      divergence: {tokens: 10240, max_seq_len: 128, top_k: 20}  # scored tokens for KL
      noise_floor: auto                      # the control's compute dtype (or off), below
      baseline_cache: true                   # reuse the baseline's evaluation (eval_cache.py)
      shadow: {traffic: ../traffic/sample.jsonl, max_requests: 24, max_tokens: 32}
      engine: kiln                           # or kiln-serve, vllm, trtllm, an http(s) URL
      engine_args: []                        # appended to the candidate's engine command

`baseline` is what `kiln compile` gates against (`kiln gate` takes --baseline instead):
`source` (the recipe's unquantised model, the default), an artifact or HF directory (relative
to the file that sets it), or an http(s) endpoint URL. `kiln compile --promote CHANNEL`
gates against what the channel requires instead (releases.py), whatever this says.

Thresholds left out (or null) take the defaults for the candidate's weight width
(`gates.decide.rules.default_policy`); `off` turns a check off (reported, not gated). YAML 1.1
reads an unquoted `off` (and `no`, `false`) as a boolean: for a threshold it means `off`;
`on`/`yes`/`true` is refused with the key named.

`decision_rule: mcnemar` (the default) gives each task pass, fail or inconclusive (see
`gates.decide.mcnemar`); `inconclusive: pass` (the default) lets an inconclusive task through, with
the loss its items could detect in the report, so the distribution checks decide;
`inconclusive: fail` makes every task prove that no loss beyond the margin happened.

`engine` is what evaluates the model sides (gates/measure/served.py): `kiln`, kiln's runtime
in this process (the default), or a serving engine kiln starts on each side in turn (`kiln-serve`,
`vllm`, `trtllm` with `engine_target`), or the URL of one already running. On a started engine
the baseline runs on the same engine, so the comparison isolates quantisation from it, and
(`engine_vs_runtime`) the candidate is scored in process too, so the report shows what the
engine itself changes. A check the engine cannot answer is reported as not measured there and
fails the gate. `engine_timeout_s` bounds an engine's start.

`noise_floor` is the control (gates/measure/noise_floor.py): a float source baseline's own weights
served by kiln's runtime and evaluated exactly as the candidate is. `auto` (the default)
computes it in the candidate's compute dtype, so the floor measures "lossless as shipped";
`bfloat16`, `float16` or `float32` names the dtype; `off` skips it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kiln.gates.decide.rules import GatePolicy, default_policy
from kiln.gates.measure.replay import ReplaySettings
from kiln.gates.measure.served import ENGINES
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.strict import StrictModel
from kiln.runtime.base.yaml12 import safe_load

DEFAULT_TASKS = ["kiln_ppl", "kiln_cloze", "kiln_next_word"]


# A threshold: a number, "off" (reported, not gated), or null/omitted (the scheme's default).
# "off" rather than null, so a dumped-and-reloaded section (the resolved recipe in a
# manifest) means the same as the file it came from.
Off = Literal["off"]
Share = Annotated[float, Field(ge=0.0, le=1.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
Positive = Annotated[float, Field(gt=0.0)]
_NEVER_OFF = {"recovery", "margin", "confidence", "power"}  # parameters of a rule, not checks


class ThresholdsSection(StrictModel):
    """Overrides of the policy's thresholds; null or a key left out keeps the default."""

    recovery: float | None = Field(None, gt=0.0, le=2.0)
    margin: float | None = Field(None, ge=0.0, le=1.0)
    confidence: float | None = Field(None, ge=0.5, lt=1.0)
    power: float | None = Field(None, gt=0.5, lt=1.0)
    flip_rate: Share | Off | None = None
    flip_rate_excess: Share | Off | None = None
    perplexity_ratio: Annotated[float, Field(ge=1.0)] | Off | None = None
    kl_mean: NonNegative | Off | None = None
    kl_p99: NonNegative | Off | None = None
    top1_agreement: Share | Off | None = None
    shadow_exact_match: Share | Off | None = None
    shadow_format_error_increase: Share | Off | None = None
    shadow_error_rate: Share | Off | None = None
    shadow_length_ratio_deviation: NonNegative | Off | None = None
    shadow_ttft_p50_ratio: Positive | Off | None = None
    shadow_tpot_p50_ratio: Positive | Off | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 turns an unquoted `off` into False, which pydantic would take as 0.0.
        if value is False and info.field_name in _NEVER_OFF:
            raise ValueError(
                "a YAML boolean (unquoted off/no/false) is not a value for this key: give a "
                "number, or leave the key out for the scheme's default"
            )
        if value is False:
            return "off"
        if value is True:
            raise ValueError(
                "a YAML boolean (unquoted on/yes/true) is not a threshold: give a number, "
                "or `off` to report the check without gating"
            )
        return value


# thresholds key -> GatePolicy field
_POLICY_FIELDS = {
    "recovery": "recovery_min",
    "margin": "margin",
    "confidence": "confidence",
    "power": "power",
    "flip_rate": "flip_rate_max",
    "flip_rate_excess": "flip_rate_excess_max",
    "perplexity_ratio": "perplexity_ratio_max",
    "kl_mean": "kl_mean_max",
    "kl_p99": "kl_p99_max",
    "top1_agreement": "top1_agreement_min",
    "shadow_exact_match": "shadow_exact_match_min",
    "shadow_format_error_increase": "shadow_format_error_increase_max",
    "shadow_error_rate": "shadow_error_rate_max",
    "shadow_length_ratio_deviation": "shadow_length_ratio_deviation_max",
    "shadow_ttft_p50_ratio": "shadow_ttft_p50_ratio_max",
    "shadow_tpot_p50_ratio": "shadow_tpot_p50_ratio_max",
}


class DivergenceSection(StrictModel):
    """Next-token KL on held-out text (top-k logprobs from both sides): texts are taken in
    order, each cut to `max_seq_len` tokens, until `tokens` positions are scored (or
    `num_texts` texts, when set, or the texts run out)."""

    enabled: bool = True
    # .jsonl ("text", or "context" + "target" fields) or plain text; default: the built-in
    # held-out text (kiln_ppl's documents, then kiln_cloze's passages)
    texts: str | None = None
    tokens: int = Field(10240, ge=1)
    num_texts: int | None = Field(None, ge=1)
    max_seq_len: int = Field(128, ge=8, le=8192)
    top_k: int = Field(20, ge=1, le=1000)


class ShadowSection(StrictModel):
    """Replay of recorded traffic for the shadow comparison; relative paths are relative to
    the gate file."""

    traffic: str | None = None
    max_requests: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(0.0, ge=0.0)
    concurrency: int = Field(1, ge=1, le=256)
    worst: int = Field(5, ge=0, le=100)
    timeout_s: float = Field(300.0, gt=0.0)

    def settings(self) -> ReplaySettings:
        return ReplaySettings(**self.model_dump(exclude={"traffic", "timeout_s"}))


class GatesSection(StrictModel):
    """What the gate measures and the thresholds it applies."""

    baseline: str = "source"
    tasks: list[str] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    tasks_dir: str | None = None
    limit: int | None = Field(None, ge=1)
    num_fewshot: int = Field(0, ge=0, le=32)
    decision_rule: Literal["mcnemar", "recovery", "noninferior", "recovery_or_noninferior"] = (
        "mcnemar"
    )
    inconclusive: Literal["pass", "fail"] = "pass"
    thresholds: ThresholdsSection = ThresholdsSection()
    divergence: DivergenceSection = DivergenceSection()
    # The control of the noise floor (gates/measure/noise_floor.py): the float baseline served by
    # the runtime in this compute dtype ("auto": the candidate's); "off" skips it.
    noise_floor: Literal["auto", "bfloat16", "float16", "float32", "off"] = "auto"
    baseline_cache: bool = True
    shadow: ShadowSection = ShadowSection()
    engine: str = "kiln"
    engine_args: list[str] = Field(default_factory=list)
    engine_target: str | None = None
    engine_timeout_s: float = Field(900.0, gt=0.0, le=86400.0)
    engine_vs_runtime: bool = True
    # A URL engine's model that is the candidate (`kiln gate --engine-model`): a property of
    # one run against one deployment, not of the recipe, so never part of a digest or key.
    engine_model: str | None = Field(None, exclude=True)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        if value in ENGINES or value.startswith(("http://", "https://")):
            return value
        raise ValueError(f"{value!r} is not one of {', '.join(ENGINES)} or an http(s):// URL")

    @field_validator("noise_floor", mode="before")
    @classmethod
    def _unquoted_off(cls, value: Any) -> Any:
        return "off" if value is False else value

    def policy(self, weight_bits: int | None) -> GatePolicy:
        """The scheme's default policy with this section's overrides applied."""
        policy = default_policy(weight_bits or 8)
        policy.rule = self.decision_rule
        policy.inconclusive = self.inconclusive
        for key, field_name in _POLICY_FIELDS.items():
            value = getattr(self.thresholds, key)
            if value is not None:
                setattr(policy, field_name, None if value == "off" else value)
        return policy


_YAML_BOOLEAN = "YAML read an unquoted on/off/yes/no/true/false as a boolean: quote it"
_UNION_TAG = re.compile(r"^(constrained-|literal\[|float$|int$|str$|bool$|none$)")


def load_gates(data: dict[str, Any] | None, where: str) -> GatesSection:
    """Validate a `gates:` mapping; UsageError lists each problem as `where: key: message`."""
    try:
        return GatesSection.model_validate(data or {})
    except ValidationError as exc:
        # A union reports once per member (`flip_rate.constrained-float`, `flip_rate.literal[..]`):
        # drop those member tags and say every alternative on one line.
        grouped: dict[str, list[str]] = {}
        for error in exc.errors():
            parts = [str(p) for p in error["loc"] if not _UNION_TAG.search(str(p))]
            messages = grouped.setdefault(".".join(parts), [])
            message = str(error["msg"]).removeprefix("Value error, ")
            if isinstance(error.get("input"), bool) and "YAML" not in message:
                message += (
                    " (YAML read an unquoted on/off/yes/no/true/false as a boolean: quote it)"
                )
            if message not in messages:
                messages.append(message)
        problems = [f"{where}: gates.{key}: {'; or '.join(msgs)}" for key, msgs in grouped.items()]
        raise UsageError("\n".join(problems)) from None


def load_gate_file(path: str | Path) -> GatesSection:
    """Read a gate file: a YAML mapping that is a `gates:` section, or holds one."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: gate file not found")
    try:
        data = safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of gate settings")
    return load_gates(data.get("gates", data), str(path))
