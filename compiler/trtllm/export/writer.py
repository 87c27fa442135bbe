"""Write a TensorRT-LLM unified checkpoint (`config.json` + `rank{N}.safetensors`).

No library writes this format from a compressed-tensors checkpoint (ModelOpt's
`export_tensorrt_llm_checkpoint` takes only a live ModelOpt-quantised model), so the
mapping is ours, written from TensorRT-LLM 1.2's loader: what each linear becomes, per
layout and tensor-parallel rank, is compiler/trtllm/export/layouts.py; this module refuses what
no layout holds, names the float linears in `exclude_modules` and walks the model. The rules
are stated in compiler/trtllm/rules/checkpoint.py; its `check_checkpoint` proves a written
checkpoint obeys them.

TensorRT-LLM 1.2 reads exactly one `rank{N}.safetensors` per rank, so a rank file of a 70B
model cannot be sharded: it is streamed. The model is walked a unit at a time (the embedding,
lm_head, each decoder layer), each unit read once for every rank: first to plan every rank
file's layout (the embedding, lm_head and each distinct decoder layer; layers alike in their
stored tensors and schemes take the first one's plan under their own names: `_Walk.plan`),
then to write each tensor at its place (runtime/formats/safetensors_writer.py). What the walk
must know before it starts (which linears are quantised, zero points, pre-quant scales) is
read off the config and the tensor names (source.py), so the export holds about one layer,
never the model.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.trtllm.export.checkpoint_config import checkpoint_config
from kiln.compiler.trtllm.export.layouts import (
    FLOAT_WEIGHTS,
    bias_tensors,
    expert_tensors,
    linear_tensors,
)
from kiln.compiler.trtllm.export.linears import (
    fuse_linears,
    head_rows,
    pad_groupwise,
    pad_linear,
    shard,
)
from kiln.compiler.trtllm.export.source import (
    GEMMA_NORMS,
    QK_NORMS,
    Layer,
    Source,
    layer_signatures,
    read_source,
)
from kiln.compiler.trtllm.rules.checkpoint import CHECKPOINT_ALGO, NOT_EXPORTED
from kiln.compiler.trtllm.rules.exclusions import (
    NO_EXCLUSIONS,
    ROWWISE,
    exclude_modules,
    rowwise_exclude_modules,
)
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.heap import reuse_within_layers
from kiln.runtime.formats.safetensors_writer import TensorSpec, Unit, plan_by_unit, write_files
from kiln.runtime.formats.weights import LinearWeights

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# HF projection → (TensorRT-LLM module, tensor-parallel role)
MODULES = {
    "o_proj": ("attention.dense", "row"),
    "gate_proj": ("mlp.fc", "column"),
    "up_proj": ("mlp.gate", "column"),
    "down_proj": ("mlp.proj", "row"),
}
# The linears of each block FP8 rowwise swaps whole (exclusions.ROWWISE_BLOCKS).
BLOCK_LINEARS = {"attention": ("qkv", "dense"), "mlp": ("fc", "gate", "proj")}


def export_checkpoint(
    model_dir: Path,
    out_dir: Path,
    *,
    tp_size: int = 1,
    dtype: str = "bfloat16",
    quant_algo: str | None = None,
) -> dict[str, Any]:
    """Export the quantised HF checkpoint in `model_dir` to a TensorRT-LLM checkpoint in `out_dir`.

    `quant_algo` is what the quantiser recorded (read off the checkpoint when None). Returns
    a record for the manifest: the checkpoint's quant algos, tp, files and notes. Memory holds
    about one decoder layer, not the model (see the module's docstring).
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: use {' or '.join(DTYPES)}")
    src = read_source(Path(model_dir), quant_algo)
    if src.quant_algo in NOT_EXPORTED:
        raise UsageError(f"{src.quant_algo}: {NOT_EXPORTED[src.quant_algo]}")
    if src.quant_algo not in CHECKPOINT_ALGO:
        raise UsageError(f"{src.quant_algo} has no TensorRT-LLM checkpoint export")
    info, algo = src.info, CHECKPOINT_ALGO[src.quant_algo]
    tp = tp_size
    width = info.moe_intermediate_size if info.moe is not None else info.intermediate_size
    if tp < 1 or (
        info.num_heads % tp or (info.num_kv_heads % tp and tp % info.num_kv_heads) or width % tp
    ):
        raise UsageError(
            f"tp_size {tp} does not split {info.num_heads} heads, {info.num_kv_heads} KV heads "
            f"and {width} MLP columns"
        )
    pre_quant = algo == "W4A8_AWQ" or (algo == "W4A16_AWQ" and src.pre_quant_scales)
    notes: list[str] = []
    if info.gemma and info.qk_norm:
        notes.append(
            f"Gemma 3 q/k norms: TensorRT-LLM's gemma model builds them with its default "
            f"epsilon 1e-5, not rms_norm_eps {src.config.get('rms_norm_eps', 1e-6)}"
        )
    if algo in ("W8A16", "W4A16"):
        notes.append(
            f"{algo}: weights stored dequantised in {dtype}; trtllm-build re-quantises "
            "them per channel"
        )
    excluded = _excluded(src)
    if excluded and algo in NO_EXCLUSIONS:
        raise UsageError(
            f"{algo} cannot keep {excluded[0]} in float: TensorRT-LLM's SmoothQuant plugin "
            "layers quantise whole attention and MLP blocks — quantise every linear of the "
            "decoder layers (ignore only lm_head), or use smoothquant with static activations"
        )
    float_head = (*FLOAT_WEIGHTS, ROWWISE)  # TensorRT-LLM keeps lm_head float for these
    head_quantised = src.quantised("lm_head")
    if algo in float_head and head_quantised:
        notes.append(
            f"{algo}: lm_head stays in {dtype} (TensorRT-LLM runs it in float under {algo})"
        )
    if algo == ROWWISE:
        exclude = rowwise_exclude_modules(_float_blocks(excluded))
    else:
        quantised_head = algo not in float_head and head_quantised
        exclude = exclude_modules(excluded, algo, lm_head_quantised=quantised_head)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reuse_within_layers()  # layers are read and freed one after another (the writer trims)
    walk = _Walk(src, algo, tp, DTYPES[dtype], pre_quant)
    files = write_files(out_dir, walk.tensors, specs=walk.plan())
    notes += walk.notes
    config = checkpoint_config(src, algo, tp, dtype, pre_quant, exclude, walk.group_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "quant_algo": config["quantization"]["quant_algo"] or "NO_QUANT",
        "kv_cache_quant_algo": src.kv_cache_quant_algo,
        "source_quant_algo": src.quant_algo,
        "source_format": src.fmt,
        "tp_size": tp,
        "dtype": dtype,
        "files": ["config.json", *files],
        "notes": notes,
    }


def _excluded(src: Source) -> list[str]:
    """TensorRT-LLM names of the decoder linears the quantiser left in float."""
    names: list[str] = []
    for i in range(src.info.num_layers):
        qkv = [
            src.quantised(f"model.layers.{i}.self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")
        ]
        if len(set(qkv)) > 1:
            raise UsageError(
                f"layer {i}: q, k and v must be all quantised or all ignored "
                "(TensorRT-LLM fuses them)"
            )
        if not qkv[0]:
            names.append(f"transformer.layers.{i}.attention.qkv")
        for hf, trt in _layer_modules(src, i).items():
            if not src.quantised(hf):
                names.append(trt)
        if src.sparse(i):  # layers/moe.py: the router is never quantised
            names.append(f"transformer.layers.{i}.mlp.router")
            _check_experts(src, i)
    return names


def _check_experts(src: Source, layer: int) -> None:
    """UsageError where some experts of a quantised checkpoint are float: TensorRT-LLM's MoE
    layer runs all experts of a layer in one format."""
    if src.quant_algo == "NO_QUANT":
        return
    names = src.expert_names(layer)  # (gate, up, down) of expert 0, then of expert 1, ...
    float_experts = sorted({e // 3 for e, name in enumerate(names) if not src.quantised(name)})
    if float_experts:
        raise UsageError(
            f"layer {layer}: experts {float_experts} are float while the checkpoint is "
            f"{src.quant_algo}: TensorRT-LLM's MoE layer runs every expert of a layer in one "
            "format — quantise every expert (drop them from quantization.ignore)"
        )


def _layer_modules(src: Source, layer: int) -> dict[str, str]:
    """HF linear → TensorRT-LLM module of decoder layer `layer`'s linears that export one to
    one (not q/k/v, Phi-3's gate and up, nor experts: those are fused or stacked per rank)."""
    hf, trt = f"model.layers.{layer}", f"transformer.layers.{layer}"
    out = {f"{hf}.self_attn.o_proj": f"{trt}.attention.dense"}
    if src.sparse(layer):
        return out
    if not src.info.fused_projections:
        out[f"{hf}.mlp.gate_proj"] = f"{trt}.mlp.fc"
        out[f"{hf}.mlp.up_proj"] = f"{trt}.mlp.gate"
    out[f"{hf}.mlp.down_proj"] = f"{trt}.mlp.proj"
    return out


def _float_blocks(excluded: list[str]) -> list[str]:
    """The attention / MLP blocks whose linears are all in `excluded`; UsageError for a block
    only partly float, which FP8 rowwise (whole-block layers) cannot express."""
    blocks = list(dict.fromkeys(name.rpartition(".")[0] for name in excluded))
    for block in blocks:
        linears = [f"{block}.{n}" for n in BLOCK_LINEARS[block.rpartition(".")[2]]]
        quantised = [n for n in linears if n not in excluded]
        if quantised:
            raise UsageError(
                f"FP8 rowwise cannot keep {next(n for n in linears if n in excluded)} in float "
                f"while {quantised[0]} is quantised: TensorRT-LLM swaps whole attention and "
                "MLP blocks — ignore every projection of that block in the recipe, or none"
            )
    return blocks


def _weight_globals(src: Source, layer: Layer) -> dict[str, torch.Tensor]:
    """NVFP4: TensorRT-LLM module of decoder layer `layer` → its per-tensor weight scale
    (q/k/v: the largest of the three, as TensorRT-LLM's own loader takes for its fused qkv)."""
    found, out = layer.weight_globals, dict[str, torch.Tensor]()
    if not found:
        return out
    hf, trt = f"model.layers.{layer.index}", f"transformer.layers.{layer.index}"
    names = [f"{hf}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    if all(n in found for n in names):
        out[f"{trt}.attention.qkv"] = torch.stack([found[n] for n in names]).max()
    gate_up = [f"{hf}.mlp.{p}" for p in ("gate_proj", "up_proj")]
    if src.info.fused_projections and all(n in found for n in gate_up):
        out[f"{trt}.mlp.fc"] = torch.stack([found[n] for n in gate_up]).max()
    for name, module in _layer_modules(src, layer.index).items():
        if name in found:
            out[module] = found[name]
    return out


@dataclass
class _Walk:
    """The checkpoint's tensors as (rank file, name, tensor), a unit (the embedding, lm_head,
    a decoder layer) at a time: `tensors()` reads each unit once and yields every rank's
    tensors of it, holding one rank's at a time. What a walk learns on the way (rank 0's
    fusion notes, the group size) is kept from the last walk; every walk learns the same."""

    src: Source
    algo: str
    tp: int
    dtype: torch.dtype
    pre_quant: bool
    notes: list[str] = field(default_factory=list)
    group_size: int | None = None

    def tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        self.notes = []
        yield from self._shared()
        yield from self._lm_head()
        for i in range(self.src.info.num_layers):
            yield from self._layer(i)

    def plan(self) -> dict[str, dict[str, TensorSpec]]:
        """The rank files' plan of `tensors()` (rank file → {name: spec}), walking each distinct
        decoder layer once: a layer whose signature (source.py `layer_signatures`: its stored
        tensors' names, dtypes and shapes, its linears' shapes and schemes) matches one walked
        already takes that layer's plan under its own names, the walk being a function of those
        alone (`plan_by_unit`). A Llama's plan so reads the embedding, lm_head and one layer,
        not the model a second time."""
        units: list[Unit] = [(None, "", self._shared), (None, "", self._lm_head)]
        for i, signature in enumerate(layer_signatures(self.src.ckpt, self.src.info)):
            units.append((signature, f"transformer.layers.{i}.", functools.partial(self._layer, i)))
        return plan_by_unit(units)

    def _file(self, rank: int) -> str:
        return f"rank{rank}.safetensors"

    def _norm(self, weight: torch.Tensor) -> torch.Tensor:
        # Gemma 3 computes x·(1 + w); TensorRT-LLM's RmsNorm x·w (models/gemma/convert.py
        # adds the one, in float32).
        return (weight.float() + 1 if self.src.info.gemma else weight).to(self.dtype)

    def _linear(
        self, prefix: str, lin: LinearWeights, role: str, weight_global: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """One (fused, sharded, padded) linear's tensors, with its bias."""
        if lin.scheme.strategy == "group" and self.group_size is None:
            self.group_size = lin.scheme.group_size
        zero_point = not self.src.symmetric
        args = (self.algo, role, self.dtype, self.pre_quant, zero_point, weight_global)
        return linear_tensors(prefix, lin, *args) | bias_tensors(prefix, lin, self.dtype)

    def _shared(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """The embedding and the final norm: the same on every rank."""
        for name, key in (("transformer.vocab_embedding.weight", "model.embed_tokens.weight"),
                          ("transformer.ln_f.weight", "model.norm.weight")):  # fmt: skip
            stored = self.src.tensor(key)
            tensor = stored.to(self.dtype) if key.startswith("model.embed") else self._norm(stored)
            for rank in range(self.tp):
                yield self._file(rank), name, tensor
            del stored, tensor  # not held while the next one is read

    def _lm_head(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """lm_head by rows, padded to a multiple of tp."""
        lin, weight_global = self.src.lm_head()
        tp = self.tp
        if lin.out_features % tp:
            lin = pad_linear(lin, -(-lin.out_features // tp) * tp, lin.in_features)
        for rank in range(tp):
            shard_ = pad_groupwise(shard(lin, "column", tp, rank), self.algo, "column", tp)
            for name, tensor in self._linear("lm_head", shard_, "column", weight_global).items():
                yield self._file(rank), name, tensor
                del tensor
            del shard_
        del lin  # not held while the first layer is read

    def _layer(self, i: int) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Decoder layer `i`, read once, on every rank."""
        layer = self.src.layer(i)
        for rank in range(self.tp):
            notes = self.notes if rank == 0 else []
            for name, tensor in self._layer_tensors(layer, rank, notes).items():
                yield self._file(rank), name, tensor
                del tensor  # the rank's dict goes with the loop: one rank's tensors at a time

    def _layer_tensors(self, layer: Layer, rank: int, notes: list[str]) -> dict[str, torch.Tensor]:
        """Decoder layer `layer`'s tensors on rank `rank`."""
        src, algo, tp, i = self.src, self.algo, self.tp, layer.index
        info, linears = src.info, layer.linears
        prefix, trt = f"model.layers.{i}", f"transformer.layers.{i}"
        globals_ = _weight_globals(src, layer)
        out: dict[str, torch.Tensor] = {}

        def linear(name: str, lin: LinearWeights, role: str) -> None:
            out.update(self._linear(name, lin, role, globals_.get(name)))

        for hf, module in _layer_modules(src, i).items():
            role = MODULES[hf.rpartition(".")[2]][1]
            linear(module, pad_groupwise(shard(linears[hf], role, tp, rank), algo, role, tp), role)
        parts = [
            linears[f"{prefix}.self_attn.{p}"].rows(head_rows(heads, info.head_dim, tp, rank))
            for p, heads in (
                ("q_proj", info.num_heads),
                ("k_proj", info.num_kv_heads),
                ("v_proj", info.num_kv_heads),
            )
        ]
        qkv = pad_groupwise(fuse_linears(parts, algo, notes, f"layer {i} qkv"), algo, "column", tp)
        linear(f"{trt}.attention.qkv", qkv, "column")
        if info.fused_projections:
            # models/phi3: one fc of [up; gate] rows (swiglu gates with the second half), each
            # rank holding its own rows of both halves.
            halves = [shard(linears[f"{prefix}.mlp.{p}"], "column", tp, rank)
                      for p in ("up_proj", "gate_proj")]  # fmt: skip
            fc = fuse_linears(halves, algo, notes, f"layer {i} gate_up")
            linear(f"{trt}.mlp.fc", pad_groupwise(fc, algo, "column", tp), "column")
        if layer.router is not None:
            out.update(expert_tensors(src, layer, algo, tp, rank, self.dtype, notes))
        norm = self._norm
        out[f"{trt}.input_layernorm.weight"] = norm(layer.norms[f"{prefix}.input_layernorm.weight"])
        out[f"{trt}.post_layernorm.weight"] = norm(
            layer.norms[f"{prefix}.post_attention_layernorm.weight"]
        )
        for gemma_norm in GEMMA_NORMS if info.gemma else ():
            out[f"{trt}.{gemma_norm}.weight"] = norm(layer.norms[f"{prefix}.{gemma_norm}.weight"])
        for qk in QK_NORMS if info.qk_norm else ():
            # models/qwen/convert.py, models/gemma/convert.py: q_norm / k_norm load as
            # attention.{q,k}_layernorm, float.
            out[f"{trt}.attention.{qk[0]}_layernorm.weight"] = norm(
                layer.norms[f"{prefix}.self_attn.{qk}.weight"]
            )
        if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
            for plugin_norm in ("input_layernorm", "post_layernorm"):
                out[f"{trt}.{plugin_norm}.scale_to_int"] = torch.ones(1, dtype=self.dtype)
        if layer.kv_scale is not None:
            out[f"{trt}.attention.kv_cache_scaling_factor"] = layer.kv_scale.reshape(1)
        return out
