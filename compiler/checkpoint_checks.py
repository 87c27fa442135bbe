"""Whether a checkpoint holds every tensor its config.json's architecture reads, in every layer,
with the shape the config implies: read from the safetensors headers of every shard, before any
compute.

transformers initialises a tensor the checkpoint lacks at random and loads on (a Mixtral without
one layer's router compiled and shipped), and skips a tensor the architecture does not read (a
layer past num_hidden_layers: the model runs shallower than its weights); both are refused here.
What transformers 5 loads is accepted: Mixtral's sparse block under `block_sparse_moe` or its own
`mlp` (conversion_mapping.py renames one to the other), each expert's projections apart or fused
into `experts.gate_up_proj` [experts, 2 x width, hidden] and `experts.down_proj` [experts,
hidden, width], and a quantised linear's weight under the name its format stores it
(`qweight` of AutoAWQ / AutoGPTQ, `weight_packed` of compressed-tensors).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.runtime.base.files import regular_problem
from kiln.runtime.formats.model_info import ModelInfo

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # a quantised weight's stored shape is its codes'
LINEAR_WEIGHTS = ("weight", "qweight", "weight_packed")
LAYER = re.compile(r"model\.layers\.(\d+)\.")
SHOWN = 4  # layers (and tensors of a layer) named before "and N more"


@dataclass
class Stored:
    """The tensors of a checkpoint's shards: name → (shape, safetensors dtype)."""

    files: list[str]
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def read_stored(model_dir: Path) -> Stored | None:
    """Every shard's header; None where one cannot be read (weight_problems names it) or the
    checkpoint holds no safetensors (a pytorch_model.bin is converted by loading it)."""
    from safetensors import SafetensorError, safe_open

    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths or any(regular_problem(p) is not None for p in paths):
        return None
    stored = Stored([p.name for p in paths])
    try:
        for path in paths:
            with safe_open(str(path), framework="numpy") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = handle.get_slice(name)
                    stored.tensors[name] = (tuple(part.get_shape()), part.get_dtype())
    except (OSError, SafetensorError):
        return None
    return stored


def expected_tensors(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """Every tensor `info`'s architecture reads, by its name in a float checkpoint, with its
    shape (a quantised checkpoint may store a linear's weight as any of LINEAR_WEIGHTS)."""
    hidden = (info.hidden_size,)
    embedding = (info.vocab_size, info.hidden_size)
    out = {"model.embed_tokens.weight": embedding, "model.norm.weight": hidden}
    if not info.tie_word_embeddings:
        out["lm_head.weight"] = embedding
    norms = ["input_layernorm", "post_attention_layernorm"]
    if info.gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for layer in range(info.num_layers):
        p = f"model.layers.{layer}."
        out.update({f"{p}{norm}.weight": hidden for norm in norms})
        if info.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = (info.head_dim,)
            out[f"{p}self_attn.k_norm.weight"] = (info.head_dim,)
        linears = info.layer_linears(layer)
        out.update({f"{p}{name}.weight": shape for name, shape in linears.items()})
        if info.qkv_bias and not info.fused_projections:
            for proj in ("q_proj", "k_proj", "v_proj"):
                out[f"{p}self_attn.{proj}.bias"] = (linears[f"self_attn.{proj}"][0],)
    return out


def _as_read(stored: Stored, info: ModelInfo) -> dict[str, tuple[tuple[int, ...], str]]:
    """The stored tensors under the names `expected_tensors` gives them: Mixtral's renamed
    block back to `block_sparse_moe`, fused experts as each expert's linears, and a quantised
    linear's codes (any of LINEAR_WEIGHTS) as its weight, of no float shape."""
    moe = info.moe
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, value in stored.tensors.items():
        if moe is not None and moe.block != "mlp" and LAYER.match(name):
            name = name.replace(".mlp.", f".{moe.block}.", 1)
        stem, _, suffix = name.rpartition(".")
        tensors[name] = value
        if suffix in LINEAR_WEIGHTS[1:]:
            tensors.setdefault(f"{stem}.weight", ((), suffix))
    if moe is not None:
        for layer in range(info.num_layers):
            tensors.update(_unfused(tensors, info, layer))
    return tensors


def _unfused(
    tensors: dict[str, tuple[tuple[int, ...], str]], info: ModelInfo, layer: int
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Sparse layer `layer`'s fused expert tensors (transformers 5's own layout) as each
    expert's gate, up and down linears; their shapes as the fused ones imply."""
    moe = info.moe
    assert moe is not None
    base = f"model.layers.{layer}.{moe.block}.experts"
    gate_up, down = tensors.get(f"{base}.gate_up_proj"), tensors.get(f"{base}.down_proj")
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    if gate_up is not None and len(gate_up[0]) == 3:
        (experts, width, hidden), dtype = gate_up
        for e in range(experts):
            for proj in (moe.gate, moe.up):
                out[f"{base}.{e}.{proj}.weight"] = ((width // 2, hidden), dtype)
    if down is not None and len(down[0]) == 3:
        (experts, hidden, width), dtype = down
        out.update({f"{base}.{e}.{moe.down}.weight": ((hidden, width), dtype)
                    for e in range(experts)})  # fmt: skip
    return out


def _listed(names: list[str], limit: int = SHOWN) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _missing(expected: dict[str, tuple[int, ...]], found: set[str]) -> list[str]:
    """What is missing: the tensors outside the layers by name, then one line per layer
    ("model.layers.3: 2 of 18 missing (...)") or run of absent layers ("model.layers.5 to
    model.layers.9: whole layers")."""
    outside = [n for n in expected if not LAYER.match(n) and n not in found]
    per: dict[int, tuple[int, list[str]]] = {}
    for name in expected:
        if (match := LAYER.match(name)) is not None:
            count, gone = per.get(int(match.group(1)), (0, []))
            per[int(match.group(1))] = (
                count + 1,
                gone + [name[match.end() :]] * (name not in found),
            )
    lines = [_listed(outside)] if outside else []
    absent: list[int] = []  # the run of whole layers missing so far
    for layer, (count, gone) in [*per.items(), (-1, (1, []))]:
        if len(gone) == count and (not absent or layer == absent[-1] + 1):
            absent.append(layer)
            continue
        if absent:
            first, last = f"model.layers.{absent[0]}", f"model.layers.{absent[-1]}"
            lines.append(f"{first} to {last}: whole layers" if len(absent) > 1 else
                         f"{first}: the whole layer")  # fmt: skip
        absent = [layer] if len(gone) == count else []
        if gone and len(gone) < count:
            lines.append(
                f"model.layers.{layer}: {len(gone)} of {count} missing ({_listed(gone, 3)})"
            )
    return lines


def completeness_problems(model_dir: Path, info: ModelInfo) -> list[str]:
    """What a checkpoint lacks, holds beyond, or holds in another shape than config.json's
    architecture reads (empty when it matches, or when its headers cannot be read)."""
    stored = read_stored(model_dir)
    if stored is None:
        return []
    files = stored.files[0] if len(stored.files) == 1 else f"its {len(stored.files)} shards"
    where = f"{model_dir} ({files})"
    tensors = _as_read(stored, info)
    expected = expected_tensors(info)
    problems = []
    lines = _missing(expected, set(tensors))
    if lines:
        shown = lines[: SHOWN + 1]
        more = f"; and {len(lines) - len(shown)} more layers" if len(lines) > len(shown) else ""
        problems.append(
            f"{where} lacks tensors {info.architecture} reads with config.json's "
            f"num_hidden_layers {info.num_layers}, which transformers would initialise at "
            f"random: {'; '.join(shown)}{more} — the checkpoint is incomplete: copy or download "
            "its missing shards again, or restore the config.json it was saved with"
        )
    beyond = sorted({int(m.group(1)) for n in stored.tensors if (m := LAYER.match(n))})
    beyond = [i for i in beyond if i >= info.num_layers]
    if beyond:
        problems.append(
            f"{where} holds layers {_listed([str(i) for i in beyond])} past config.json's "
            f"num_hidden_layers {info.num_layers}; transformers skips them (unexpected keys) and "
            "would run a shallower model than these weights — restore the model's own "
            "config.json"
        )
    wrong = [
        f"{name} is {list(tensors[name][0])} in the weights but config.json implies {list(shape)}"
        for name, shape in expected.items()
        if name in tensors and tensors[name][1] in FLOAT_DTYPES and tensors[name][0] != shape
    ]
    if wrong:
        more = f" (and {len(wrong) - 3} more tensors)" if len(wrong) > 3 else ""
        problems.append(
            f"{'; '.join(wrong[:3])}{more}; the config does not belong to these weights — "
            "restore the model's own config.json"
        )
    return problems
