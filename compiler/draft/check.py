"""The recipe's `speculative:` section in preflight: the draft checked like the model (its
source, architecture and quantisation resolved the same way), its tokenizer against the
model's, and what to compile beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.compiler import sources
from kiln.compiler.draft.tokenizer_match import tokenizer_differences, tokenizer_facts
from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.resolve import resolve_scheme
from kiln.compiler.trtllm.rules.support import check_target
from kiln.compiler.trtllm.targets import PROFILES
from kiln.quant.prequantized.convert import PreQuantized
from kiln.quant.registry import Problem
from kiln.quant.schemes import FLOAT_SCHEME
from kiln.quant.spec import Scheme
from kiln.runtime.base.errors import SourceError
from kiln.runtime.formats.model_info import ModelInfo


@dataclass
class SpeculativePlan:
    """The recipe's `speculative:` section after preflight: what to compile and how."""

    method: str  # draft | ngram
    max_draft_len: int | None  # None: auto
    auto_prompts: int = 8
    auto_max_tokens: int = 32
    auto_max_k: int = 8
    max_matching_ngram_size: int = 3
    external_draft_engine: bool = False  # also plan an engine for external draft tokens
    source: sources.SourceRef | None = None  # the draft's
    info: ModelInfo | None = None
    scheme: Scheme = FLOAT_SCHEME  # the draft's, resolved in preflight
    imported: PreQuantized | None = None  # a pre-quantised AWQ/GPTQ draft, converted as is
    recipe_section: dict[str, Any] = field(default_factory=dict)  # speculative.draft, defaulted


def check_speculative(
    recipe: Recipe,
    resolved: dict[str, Any],
    target_ref: sources.SourceRef | None,
    target_info: ModelInfo | None,
) -> tuple[SpeculativePlan | None, list[str]]:
    """Check the `speculative:` section like the model's own (`resolved`: the defaulted
    recipe); returns (plan, problems)."""
    section = recipe.config.speculative
    if section is None:
        return None, []
    out = SpeculativePlan(
        method=section.method,
        max_draft_len=None if section.max_draft_len == "auto" else int(section.max_draft_len),
        auto_prompts=section.auto_prompts,
        auto_max_tokens=section.auto_max_tokens,
        auto_max_k=section.auto_max_k,
        max_matching_ngram_size=section.max_matching_ngram_size,
        external_draft_engine=section.external_draft_engine,
        recipe_section=(resolved.get("speculative") or {}).get("draft", {}),
    )
    draft_spec = recipe.draft_quant_spec()
    if section.draft is None or draft_spec is None:
        return out, []
    key = "speculative.draft.source"
    problems: list[str] = []
    try:
        out.source = sources.parse_source(section.draft.source, recipe.base_dir(key))
        out.info = sources.inspect_source(out.source)
    except SourceError as exc:
        # Its message names `model.source` (the key it was written for); this is the draft's.
        return out, [recipe.problem(key, exc.message.removeprefix("model.source "))]
    info = out.info
    arch_problems = sources.check_architecture(info)
    problems += [recipe.problem(key, p) for p in arch_problems]
    quant = resolve_scheme(recipe, draft_spec, info, recipe.calibration_spec(),
                                 key="speculative.draft.quantization",
                                 detect=not arch_problems)  # fmt: skip
    problems += quant.problems
    out.imported = quant.imported
    if quant.scheme is not None:
        out.scheme = quant.scheme
    for index, target in enumerate(recipe.config.targets):
        if target not in PROFILES:
            continue  # the model's own check names it
        path = recipe.config.deploy.trtllm_path
        if quant.scheme is None:
            found = [Problem("targets", f"cannot check {target}: the quantization section "
                             "does not resolve to a TensorRT-LLM scheme",
                             "fix the quantization problems first")]  # fmt: skip
        else:
            found = check_target(quant.scheme, target, path=path)
        problems += [
            recipe.problem(f"targets.{index}", f"the draft: {p.problem}", p.allowed) for p in found
        ]
    if target_info is not None and info.num_parameters >= target_info.num_parameters:
        problems.append(
            recipe.problem(
                key,
                f"the draft ({info.num_parameters / 1e6:.0f}M parameters) is not smaller than "
                f"the model ({target_info.num_parameters / 1e6:.0f}M), so drafting cannot pay",
                "use a smaller model of the same family, or make one with `kiln draft`",
            )
        )
    if target_ref is not None:
        differences = tokenizer_differences(
            tokenizer_facts(target_ref), tokenizer_facts(out.source)
        )
        if differences:
            problems.append(
                recipe.problem(
                    key,
                    f"the draft's tokenizer differs from the model's ({target_ref.spec}): "
                    + "; ".join(differences),
                    "draft and target must share one tokenizer: use a draft of the same model "
                    "family, or make one from the model with `kiln draft`",
                )
            )
    return out, problems
