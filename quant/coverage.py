"""Quantiser coverage: which linears of a quantised checkpoint hold codes, counted by kind
(attention, MLP, expert, router, lm_head), and the ones left float that neither the recipe's
`ignore` list nor kiln's own rule (MoE routers stay float) keeps float.

Hand-written: no quantiser reports this, and the field has shipped what it catches (ModelOpt
PR #1382: "All 20,480 expert quantizers were silently skipped"; PR #1596: a recipe that
matched nothing exported an all-BF16 checkpoint). Reads which tensors the checkpoint stores
(`Checkpoint.is_quantised`), no weights.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from kiln.quant.selection import is_ignored
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.model_info import ModelInfo

KINDS = ("attention", "mlp", "expert", "router", "lm_head")


def linear_kind(name: str, info: ModelInfo) -> str:
    """attention, mlp, expert, router or lm_head, from a full module name."""
    if name == "lm_head":
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".experts." in name:
        return "expert"
    moe = info.moe
    if moe is not None and name.endswith(f".{moe.block}.{moe.router}"):
        return "router"
    return "mlp"


def coverage(model_dir: Path, info: ModelInfo, ignore: tuple[str, ...]) -> dict[str, Any]:
    """Per kind, how many linears are quantised and float; the float ones nothing keeps
    float (`unexpected_float`); and the total quantised."""
    ckpt = open_checkpoint(Path(model_dir))
    names = [
        f"model.layers.{layer}.{local}"
        for layer in range(info.num_layers)
        for local in info.layer_linears(layer)
    ]
    if ckpt.has_linear("lm_head"):  # a tied head is the embedding, stored once
        names.append("lm_head")
    counts: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    unexpected = []
    for name in names:
        kind = linear_kind(name, info)
        quantised = ckpt.is_quantised(name)
        counts[kind]["quantised" if quantised else "float"] += 1
        if not quantised and kind != "router" and not is_ignored(name, ignore):
            unexpected.append(name)
    return {
        "counts": {kind: dict(c) for kind, c in counts.items() if c},
        "quantised": sum(c["quantised"] for c in counts.values()),
        "unexpected_float": unexpected,
    }


def coverage_problem(found: dict[str, Any], scheme: str) -> str | None:
    """Why a checkpoint's coverage is wrong for `scheme` (None when it is right)."""
    if found["quantised"] == 0:
        return (
            f"{scheme} quantised none of the model's linears: the checkpoint is all float "
            "— check quantization.ignore and the quantiser's log"
        )
    unexpected = found["unexpected_float"]
    if not unexpected:
        return None
    shown = ", ".join(unexpected[:6]) + (
        f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else ""
    )
    return (
        f"{scheme} left {len(unexpected)} linear(s) float that neither quantization.ignore nor "
        f"kiln's rules keep float: {shown} — add them to quantization.ignore to keep them "
        "float on purpose, or report the quantiser that skipped them"
    )
