"""A quantised Hugging Face checkpoint as the TensorRT-LLM export sees it.

The checkpoint is read by the runtime's reader (`kiln.runtime.formats.checkpoint`:
compressed-tensors, ModelOpt HF export or float) into `LinearWeights`, in the quantiser's own
convention so that nothing is lost before export: y = (x * pre_quant_scale) @ ((code - zero) *
scale)^T. What this module adds is what only the export needs: the TensorRT-LLM QuantAlgo of the
checkpoint, the model's shapes, and refusing what TensorRT-LLM's layouts cannot hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.trtllm.rules.engine import engine_problem
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.checkpoint import Checkpoint, open_checkpoint
from kiln.runtime.formats.checkpoint.compressed_tensors import CompressedTensors
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.weights import LinearWeights, WeightScheme, effective_weight

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's and Gemma 3's per-head norms, float in every export
# Gemma 3's norms before and after the MLP (its sandwich norms), besides Llama's two.
GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
KV_CACHE_ALGO = {"fp8": "FP8", "int8": "INT8"}


@dataclass
class Source:
    """A quantised checkpoint in memory: shapes, scheme, linears and the float rest."""

    config: dict[str, Any]
    info: ModelInfo
    quant_algo: str
    kv_cache_quant_algo: str | None
    symmetric: bool
    fmt: str  # compressed-tensors | modelopt | float
    linears: dict[str, LinearWeights] = field(default_factory=dict)  # HF module name → linear
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # embeddings, norms
    kv_scales: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → dequant scale
    # NVFP4: HF module name → its per-tensor weight scale (`weight_scale_2`), which the
    # reader folds into the block scales and the TensorRT-LLM layout keeps apart.
    weight_globals: dict[str, torch.Tensor] = field(default_factory=dict)
    # Mixture of experts: sparse layer → its router's float32 weight (num_experts, hidden).
    routers: dict[int, torch.Tensor] = field(default_factory=dict)
    # Phi-3: each split-off projection → the fused HF module it was stored in.
    fused_in: dict[str, str] = field(default_factory=dict)

    def experts(self, layer: int) -> list[tuple[LinearWeights, LinearWeights, LinearWeights]]:
        """(gate, up, down) of each expert of sparse layer `layer`, in expert order."""
        moe = self.info.moe
        assert moe is not None
        base = f"model.layers.{layer}.{moe.block}.experts"
        get = self.linears.__getitem__
        return [
            (
                get(f"{base}.{e}.{moe.gate}"),
                get(f"{base}.{e}.{moe.up}"),
                get(f"{base}.{e}.{moe.down}"),
            )
            for e in range(self.info.num_experts)
        ]


def trtllm_algo(scheme: WeightScheme, actorder: bool) -> str:
    """The TensorRT-LLM QuantAlgo of a compressed-tensors weight scheme."""
    a = scheme.activations
    if scheme.type == "float":
        return "FP8" if scheme.strategy == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
    if a is not None and a.type == "int":
        return "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" if a.dynamic else "W8A8_SQ_PER_CHANNEL"
    if a is not None and a.type == "float":
        return "W4A8_AWQ"
    grouped = scheme.strategy == "group"
    if scheme.num_bits == 8:
        return "W8A16_GPTQ" if grouped else "W8A16"
    if not grouped:
        return "W4A16"
    return "W4A16_GPTQ" if actorder else "W4A16_AWQ"  # GPTQ records its act order


def _recorded_algo(ckpt: Checkpoint) -> str:
    """The QuantAlgo the checkpoint records (ModelOpt) or implies (compressed-tensors)."""
    quant = ckpt.quant
    if isinstance(quant, CompressedTensors):
        if len(quant.groups) != 1:
            raise UsageError(
                "compressed-tensors checkpoints with several config_groups (mixed "
                "precision) have no single TensorRT-LLM quant_algo"
            )
        group = quant.groups[0]
        return trtllm_algo(group.weights, group.actorder)
    return quant.quant_algo or "NO_QUANT"


def read_source(model_dir: Path, quant_algo: str | None = None) -> Source:
    """Load `model_dir` (compressed-tensors, ModelOpt HF export or float).

    `quant_algo` is the TensorRT-LLM algorithm the quantiser recorded (the manifest's
    `trtllm_quant_algo`); without it the algorithm is read off the checkpoint (W4A16 GPTQ
    and AWQ differ there only by GPTQ's recorded `actorder`).
    """
    ckpt = open_checkpoint(Path(model_dir))
    info = ModelInfo.from_hf_config(ckpt.config)
    recorded = _recorded_algo(ckpt)
    if (why := engine_problem(info, quant_algo or recorded)) is not None:
        raise UsageError(f"{model_dir}: {why.problem}")
    src = Source(
        ckpt.config,
        info,
        quant_algo or recorded,
        KV_CACHE_ALGO.get(ckpt.kv_cache or ""),
        symmetric=True,
        fmt=ckpt.format,
    )
    for i in range(info.num_layers):
        _read_layer(ckpt, src, i)
    for name, lin in src.linears.items():
        if lin.g_idx is not None:
            raise UsageError(
                f"{name}: GPTQ activation reordering (g_idx) has no TensorRT-LLM layout"
            )
    embed = ckpt.tensor("model.embed_tokens.weight")
    # Tied to the embedding (SmolLM2, Qwen2-0.5B) where the checkpoint stores no lm_head.
    tied = LinearWeights(WeightScheme(), embed)
    src.linears["lm_head"] = ckpt.linear("lm_head") if ckpt.has_linear("lm_head") else tied
    src.symmetric = all(lin.scheme.symmetric for lin in src.linears.values())
    if recorded == "NVFP4":
        for name, lin in src.linears.items():
            if lin.scale is not None:
                stored = src.fused_in.get(name, name)
                scale_2 = ckpt.tensor(f"{stored}.weight_scale_2").to(torch.float32).reshape(())
                src.weight_globals[name] = scale_2
    src.tensors["model.embed_tokens.weight"] = embed
    src.tensors["model.norm.weight"] = ckpt.tensor("model.norm.weight")
    for i in range(info.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            key = f"model.layers.{i}.{norm}.weight"
            src.tensors[key] = ckpt.tensor(key)
        for norm in QK_NORMS if info.qk_norm else ():
            key = f"model.layers.{i}.self_attn.{norm}.weight"
            src.tensors[key] = ckpt.tensor(key)
        for norm in GEMMA_NORMS if info.gemma else ():
            key = f"model.layers.{i}.{norm}.weight"
            src.tensors[key] = ckpt.tensor(key)
        if ckpt.kv_cache is not None:
            k, v = (s.to(torch.float32).reshape(()) for s in ckpt.kv_scales(i))
            src.kv_scales[i] = torch.maximum(k, v)
    return src


def _read_layer(ckpt: Checkpoint, src: Source, layer: int) -> None:
    """Decoder layer `layer`'s linears into `src.linears` under Llama's HF names (Phi-3's
    fused qkv_proj and gate_up_proj split by rows: the export fuses per rank again), a sparse
    layer's experts under their own names and its router as a float32 tensor."""
    info, prefix = src.info, f"model.layers.{layer}"
    moe = info.moe
    for name, (rows, _) in info.layer_linears(layer).items():
        full = f"{prefix}.{name}"
        lin = ckpt.linear(full)
        if moe is not None and name == f"{moe.block}.{moe.router}":
            src.routers[layer] = effective_weight(lin, torch.float32)
        elif name == "self_attn.qkv_proj":
            q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
            parts = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
            _split(src, full, lin, {f"{prefix}.self_attn.{p}": at for p, at in parts.items()})
        elif name == "mlp.gate_up_proj":
            half = rows // 2
            parts = {"gate_proj": (0, half), "up_proj": (half, half)}
            _split(src, full, lin, {f"{prefix}.mlp.{p}": at for p, at in parts.items()})
        else:
            src.linears[full] = lin


def _split(src: Source, fused: str, lin: LinearWeights, parts: dict[str, tuple[int, int]]) -> None:
    """The rows (start, count) of fused linear `fused` as linears of their own."""
    for name, (start, count) in parts.items():
        src.linears[name] = lin.rows(torch.arange(start, start + count))
        src.fused_in[name] = fused
