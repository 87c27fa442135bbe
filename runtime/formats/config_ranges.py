"""The values config.json's fields may take, checked where a model is read (ModelInfo).

Each problem names the key, the value and what would work, and reads after "config.json has":
a damaged or hostile config is refused before any compute, instead of crashing a stage after
work started or loading as a silently different model (transformers only warns about most of
these; the runtime's kernels divide by them).
"""

from __future__ import annotations

import math
from typing import Any

# The float dtypes a checkpoint's weights are stored in (config.json's dtype / torch_dtype).
DTYPES = ("float32", "bfloat16", "float16")
# The attention kinds of config.json's layer_types that the runtime runs.
LAYER_TYPES = ("full_attention", "sliding_attention")
SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
         "vocab_size", "num_key_value_heads", "head_dim", "max_position_embeddings")  # fmt: skip


class ConfigValueError(ValueError):
    """config.json holds values a model cannot run with; the message lists each one."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))


def _count(value: Any) -> int | None:
    """`value` as a whole number, None when it is none (a bool, a string, 2.5, inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) and value == int(value) else None


def _whole(value: Any) -> bool:
    """Whether `value` is a whole number of at least 1."""
    return (_count(value) or 0) >= 1


def _positive(value: Any) -> bool:
    """Whether `value` is a finite number above zero."""
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value > 0)  # fmt: skip


def size_problems(config: dict[str, Any]) -> list[str]:
    """Sizes the shapes are made of that are not whole numbers of at least 1 (a size the config
    leaves out is the parser's to name), and a weights' dtype that is no float one."""
    problems = [
        f"{key} {config[key]!r} (a size: a whole number of at least 1)"
        for key in SIZES
        if config.get(key) is not None and not _whole(config[key])
    ]
    return problems + [
        f"{key} {config[key]!r} (the weights' dtype: {', '.join(DTYPES)})"
        for key in ("dtype", "torch_dtype")
        if config.get(key) is not None and str(config[key]).removeprefix("torch.") not in DTYPES
    ]


def moe_problems(
    config: dict[str, Any], width_key: str, layers: int, dense_keys: bool
) -> list[str]:
    """A mixture of experts' counts: experts per sparse layer, experts a token uses, each
    expert's width, and (where the family reads them) the keys that make layers dense."""
    key = next((k for k in ("num_local_experts", "num_experts") if k in config), None)
    experts = _count(config.get(key)) if key else None
    problems = []
    what = "the experts of each sparse layer: a whole number of at least 1"
    if key is None:
        problems.append(f"no num_local_experts ({what})")
    elif not _whole(experts):
        problems.append(f"{key} {config[key]!r} ({what})")
    top_k = config.get("num_experts_per_tok")
    most = experts if experts is not None and experts >= 1 else None
    if not _whole(top_k) or (most is not None and (_count(top_k) or 0) > most):
        within = f"1 to {key} {most}" if most else "from 1 to the number of experts"
        problems.append(f"num_experts_per_tok {top_k!r} (the experts each token uses: {within})")
    if width_key not in SIZES and not _whole(config.get(width_key)):
        problems.append(
            f"{width_key} {config.get(width_key)!r} (each expert's MLP width: at least 1)"
        )
    if not dense_keys:
        return problems
    step = config.get("decoder_sparse_step", 1)
    if step is not None and not _whole(step):
        problems.append(
            f"decoder_sparse_step {step!r} (every decoder_sparse_step-th layer is sparse: a whole "
            "number of at least 1; 1 makes every layer sparse)"
        )
    only = config.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(_count(i) not in range(layers) for i in only):
        problems.append(
            f"mlp_only_layers {only!r} (the dense layers: a list of layer indices from 0 to "
            f"{layers - 1}, num_hidden_layers {layers} minus one)"
        )
    return problems


def attention_problems(
    config: dict[str, Any], layers: int, window: Any, gemma: bool = False
) -> list[str]:
    """The sliding window where one is used, layer_types against num_hidden_layers (or Gemma's
    sliding_window_pattern where it has none), the norms' epsilon and Gemma's query scale."""
    problems = []
    pattern = config.get("sliding_window_pattern")
    if gemma and config.get("layer_types") is None and pattern is not None and not _whole(pattern):
        problems.append(
            f"sliding_window_pattern {pattern!r} (every sliding_window_pattern-th layer attends "
            "globally: a whole number of at least 1)"
        )
    if window is not None and not _whole(window):
        problems.append(
            f"sliding_window {window!r} (the tokens a sliding layer attends to: a whole number of "
            "at least 1, or null for none)"
        )
    types = config.get("layer_types")
    if types is not None:
        kinds = " or ".join(LAYER_TYPES)
        if not isinstance(types, list):
            problems.append(f"layer_types {types!r} (a list with one entry per layer: {kinds})")
        elif len(types) != layers:
            problems.append(
                f"layer_types of {len(types)} entries for num_hidden_layers {layers} (one entry "
                f"per layer, each {kinds})"
            )
        problems += [
            f"layer_types[{i}] {kind!r} (each entry {kinds})"
            for i, kind in enumerate(types if isinstance(types, list) else [])
            if kind not in LAYER_TYPES
        ][:3]
    eps = config.get("rms_norm_eps")
    if eps is not None and not _positive(eps):
        problems.append(f"rms_norm_eps {eps!r} (the norms' epsilon: a number above 0)")
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None and not _positive(scalar):
        problems.append(
            f"query_pre_attn_scalar {scalar!r} (scores are scaled by its -1/2 power: a number "
            "above 0)"
        )
    return problems


def rotary_problems(key: str, factor: Any, head_dim: int) -> list[str]:
    """partial_rotary_factor (`factor`, spelled in config.json as `key`): RoPE rotates the first
    int(head_dim * factor) channels of each head, in two halves, so they must be an even
    number of at least 2."""
    what = "the share of each head RoPE rotates"
    if not _positive(factor) or factor > 1:
        return [f"{key} {factor!r} ({what}: a number above 0, at most 1)"]
    rotated = int(head_dim * factor)
    if rotated < 2 or rotated % 2:
        return [
            f"{key} {factor!r} ({what}: {rotated} of head_dim {head_dim} channels, where RoPE "
            "rotates pairs: a share that leaves an even number, at least 2)"
        ]
    return []


def rope_problems(
    config: dict[str, Any],
    rope: dict[str, Any],
    where: str,
    rotary_dim: int | None,
    bases: dict[str, Any],
) -> list[str]:
    """RoPE's bases (`bases`: each base's config.json key → value) and parameters (`rope`:
    the merged rope_scaling / rope_parameters, spelled in config.json as `where`) for the
    scalings the runtime computes: linear, llama3 and LongRoPE (`rotary_dim`: the channels of
    a head it rotates, which LongRoPE's factor lists match; None where that is itself wrong)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_positions = _count(config.get("max_position_embeddings", 2048)) or 0  # transformers'
    problems = [
        f"{key} {base!r} (RoPE's base: a number above 0)"
        for key, base in bases.items()
        if not _positive(base)
    ]
    if kind == "longrope":  # Phi-3's transformers 4 configs keep it at the top level
        top = config.get("original_max_position_embeddings")
        rope = {"original_max_position_embeddings": top, **rope}

    def need(key: str, what: str) -> None:
        if not _positive(rope.get(key)):
            problems.append(f"{where}.{key} {rope.get(key)!r} ({kind} RoPE: {what})")

    if kind in ("linear", "llama3"):
        need("factor", "positions are divided by it, a number above 0")
    if kind == "llama3":
        need("low_freq_factor", "a number above 0, below high_freq_factor")
        need("high_freq_factor", "a number above low_freq_factor")
        low, high = rope.get("low_freq_factor", 0), rope.get("high_freq_factor", 0)
        if _positive(low) and _positive(high) and low >= high:
            problems.append(
                f"{where}.low_freq_factor {low!r} not below high_freq_factor {high!r} (llama3 "
                "RoPE blends frequencies between them: low_freq_factor < high_freq_factor)"
            )
        original = rope.get("original_max_position_embeddings")
        if not 1 <= (_count(original) or 0) <= max_positions:
            problems.append(
                f"{where}.original_max_position_embeddings {original!r} (llama3 RoPE: the "
                f"pre-training context, from 1 to max_position_embeddings {max_positions})"
            )
    # LongRoPE's factor lists, one per rotated pair (unjudged where the rotary dim is wrong)
    if kind == "longrope" and rotary_dim is not None:
        for key in ("short_factor", "long_factor"):
            factors = rope.get(key)
            if not isinstance(factors, list):
                shown = f"{key} {factors!r}"
            elif len(factors) != rotary_dim // 2:
                shown = f"{key} of {len(factors)} values"
            else:
                bad = next((i for i, f in enumerate(factors) if not _positive(f)), None)
                if bad is None:
                    continue
                shown = f"{key}[{bad}] {factors[bad]!r}"
            problems.append(
                f"{where}.{shown} (LongRoPE: one factor per rotated pair of the {rotary_dim} "
                f"rotary dimensions, {rotary_dim // 2} finite numbers above 0)"
            )
    if kind == "longrope":
        for key in ("factor", "attention_factor"):
            if rope.get(key) is not None:
                need(key, "a number above 0, or leave it out")
        original = rope.get("original_max_position_embeddings")
        if original is not None and not _whole(original):
            problems.append(
                f"{where}.original_max_position_embeddings {original!r} (LongRoPE: the "
                "pre-training context, a whole number of at least 1)"
            )
    return problems
