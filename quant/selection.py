"""Which of a model's linears a recipe quantises: its `ignore` entries matched against full
module names (llm-compressor's convention, which ModelOpt's exclusions follow too)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.runtime.formats.model_info import ModelInfo


def is_ignored(name: str, ignore: tuple[str, ...]) -> bool:
    """Does a module name match an `ignore` entry?

    An entry is a module name or dotted suffix (`lm_head`, `down_proj`,
    `layers.0.mlp.down_proj`) or, after `re:`, a regular expression matched from the start
    of the full name (llm-compressor's convention).
    """
    return any(re.match(p, name) for p in ignore_regexes(ignore))


def ignore_regexes(ignore: tuple[str, ...]) -> list[str]:
    """`ignore` entries as regular expressions over full module names."""
    return [e[3:] if e.startswith("re:") else rf"^(?:.*\.)?{re.escape(e)}$" for e in ignore]


def quantised_linears(info: ModelInfo, ignore: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear that will be quantised, by full module name (a MoE router
    never is: kiln keeps it float, as TensorRT-LLM and vLLM expect)."""
    router = f".{info.moe.block}.{info.moe.router}" if info.moe else None
    out: dict[str, tuple[int, int]] = {}
    for layer in range(info.num_layers):
        for name, shape in info.layer_linears(layer).items():
            if router is None or not f".{name}".endswith(router):
                out[f"model.layers.{layer}.{name}"] = shape
    out["lm_head"] = (info.vocab_size, info.hidden_size)
    return {name: shape for name, shape in out.items() if not is_ignored(name, ignore)}
