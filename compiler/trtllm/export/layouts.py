"""The tensors one linear becomes in a TensorRT-LLM unified checkpoint, per layout.

No library writes this format from a compressed-tensors checkpoint (ModelOpt's
`export_tensorrt_llm_checkpoint` takes only a live ModelOpt-quantised model), so the
mapping is ours, written from TensorRT-LLM 1.2's loader: `preprocess_weights` in
tensorrt_llm/models/modeling_utils.py and the layers in tensorrt_llm/quantization/layers.py.

Layouts, chosen so one checkpoint builds on every GPU (trtllm-build lays quantised weights
out for the GPU it runs on only for the ModelOpt-flow algorithms):
- NO_QUANT: weights in `dtype`.
- FP8: float8 weight, per-tensor `weights_scaling_factor` and `activation_scaling_factor`.
  A fused GEMM (qkv, fc/gate are separate in TRT-LLM) has one weight scale: q, k and v are
  re-quantised to the largest of their scales, as ModelOpt does (`notes` says how much moved).
- FP8_PER_CHANNEL_PER_TOKEN (FP8 rowwise, dynamic per-token activations): float8 weight and
  `per_channel_scale` (out,) float32; lm_head in `dtype` (the loader requires it float). A
  float linear keeps its whole attention or MLP block (and the norm feeding it) float.
- W4A16_AWQ: int4 codes packed two output rows per byte, (out/2, in) int8, ModelOpt's
  packing (`pack_int4_rows`; the runtime's reader unpacks it); `weights_scaling_factor`
  (out, in/group) float32; `prequant_scaling_factor` where the quantiser kept one;
  asymmetric groups add `zero` = -zero_point × scale laid out (in/group, out) in `dtype`,
  as the groupwise kernel reads it (w = code × scale + zero).
- W4A8_AWQ (ModelOpt): the W4A16_AWQ tensors, `prequant_scaling_factor` on every linear
  (ones where ModelOpt folded it into the norm: TensorRT-LLM divides it by the activation
  scale), the static FP8 `activation_scaling_factor`, and `weights_scaling_factor_2`, the
  per-tensor scale that lets the kernel hold the group scales in FP8: the largest group scale
  × 7 / 448 (the layer's max |w| over FP8's max), as ModelOpt's own writer sets it. Features
  pad to a multiple of max(128, group) × tp.
- NVFP4 (ModelOpt): e2m1 codes packed two input columns per byte, (out, in/2) uint8; FP8
  `weights_scaling_factor` per block of 16 inputs, float32 `weights_scaling_factor_2` per
  tensor (q, k and v share theirs: ModelOpt makes them equal) and the activations' global
  `activation_scaling_factor`, as ModelOpt's own writer lays them out.
- W4A16_GPTQ: exported as W4A16_AWQ (same groupwise kernel; TensorRT-LLM's W4A16_GPTQ
  layout is pre-interleaved for one GPU architecture). `producer.source_quant_algo` keeps
  the original name.
- W8A16 and W4A16 (per channel): dequantised weights in `dtype`; trtllm-build quantises
  them itself (symmetric, per channel) — its codes can differ from the quantiser's.
- W8A8_SQ_PER_CHANNEL (static activations): int8 weight, `weights_scaling_factor` (out,),
  `activation_scaling_factor`, `prequant_scaling_factor` (the "ootb" layers).
- W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN (dynamic activations): int8 weight,
  `per_channel_scale` (1, out), `smoother` (1, in) on dense and proj, `scale_to_int` on the
  two norms (the plugin layers).
- KV cache FP8/INT8: `attention.kv_cache_scaling_factor` = max(k_scale, v_scale).
Tensor parallel: qkv by heads (KV heads replicated when tp exceeds them), fc/gate/lm_head by
rows (lm_head padded to a multiple of tp), dense/proj by columns; embedding replicated.
Group-wise linears are padded to the shapes TensorRT-LLM's group-wise layer creates
(features up to a multiple of max(64, group) × tp): each rank's own slice, then zeros, as
the group-wise GEMM plugin reads them (K from the activation: a rank reads its shard's
leading rows; cpp/tensorrt_llm/plugins/weightOnlyGroupwiseQuantMatmulPlugin `enqueue`).
`exclude_modules` names the float linears as ModelOpt's writer does; for W8A16/W4A16 it also
restates TensorRT-LLM's default exclusions and each name's tensors. The rules are stated in
compiler/trtllm/rules/checkpoint.py; its `check_checkpoint` proves a written checkpoint obeys them.
"""

from __future__ import annotations

import torch

from kiln.compiler.trtllm.export.linears import fuse_linears, pack_int4_rows, shard
from kiln.compiler.trtllm.export.source import Layer, Source
from kiln.compiler.trtllm.rules.exclusions import ROWWISE
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.weights import LinearWeights, effective_weight

INT4_AWQ = ("W4A16_AWQ", "W4A8_AWQ")  # ModelOpt's packed int4 layout
FLOAT_WEIGHTS = ("NO_QUANT", "W8A16", "W4A16")  # trtllm-build quantises these itself


def bias_tensors(prefix: str, lin: LinearWeights, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A linear's bias tensor (Qwen2's q/k/v), if it has one."""
    return {} if lin.bias is None else {f"{prefix}.bias": lin.bias.to(dtype).contiguous()}


def float_weight(lin: LinearWeights, dtype: torch.dtype) -> torch.Tensor:
    """The weight the layer computes with, in `dtype`; a float weight cast directly, never
    through a float32 copy of it (the same values: every cast rounds from float32 exactly)."""
    if lin.scale is None and lin.pre_quant_scale is None:
        return lin.weight.to(dtype)
    return effective_weight(lin, dtype)


def linear_tensors(
    prefix: str,
    lin: LinearWeights,
    algo: str,
    role: str,
    dtype: torch.dtype,
    pre_quant: bool,
    zero_point: bool,
    weight_global: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one (fused, sharded) linear's weight (`weight_global`: its
    NVFP4 per-tensor weight scale)."""
    if algo in FLOAT_WEIGHTS or lin.scale is None or (algo == ROWWISE and prefix == "lm_head"):
        return {f"{prefix}.weight": float_weight(lin, dtype).contiguous()}
    f32 = torch.float32
    one = torch.ones(1, dtype=f32)
    act = lin.input_scale.reshape(1).to(f32) if lin.input_scale is not None else one
    pqs = lin.pre_quant_scale
    if algo == "FP8":
        return {
            f"{prefix}.weight": lin.weight.contiguous(),
            f"{prefix}.weights_scaling_factor": lin.scale[:1, 0].to(f32),
            f"{prefix}.activation_scaling_factor": act,
        }
    if algo == "NVFP4":
        assert weight_global is not None and lin.input_scale is not None
        return {
            f"{prefix}.weight": nvfp4.pack_e2m1(lin.weight),
            f"{prefix}.weights_scaling_factor": (lin.scale / weight_global).to(torch.float8_e4m3fn),
            f"{prefix}.weights_scaling_factor_2": weight_global.reshape(()),
            f"{prefix}.activation_scaling_factor": lin.input_scale.to(f32).reshape(()),
        }
    if algo == ROWWISE:
        return {
            f"{prefix}.weight": lin.weight.contiguous(),
            f"{prefix}.per_channel_scale": lin.scale[:, 0].to(f32).contiguous(),
        }
    if algo in INT4_AWQ:
        out = {
            f"{prefix}.weight": pack_int4_rows(lin.weight).contiguous(),
            f"{prefix}.weights_scaling_factor": lin.scale.to(f32).contiguous(),
        }
        if pre_quant:
            out[f"{prefix}.prequant_scaling_factor"] = (
                pqs if pqs is not None else torch.ones(lin.in_features)
            ).to(dtype)
        if zero_point:  # w = code × scale + zero, with zero = −zero_point × scale
            points = lin.zero_point if lin.zero_point is not None else torch.zeros(lin.scale.shape)
            zero = -points.to(f32) * lin.scale.to(f32)
            out[f"{prefix}.zero"] = zero.t().contiguous().to(dtype)
        if algo == "W4A8_AWQ":  # max |w| = 7 × the largest group scale; FP8's max is 448
            out[f"{prefix}.weights_scaling_factor_2"] = (lin.scale.max() * (7 / 448)).reshape(1)
            out[f"{prefix}.activation_scaling_factor"] = act
        return out
    if algo == "W8A8_SQ_PER_CHANNEL":
        return {
            f"{prefix}.weight": lin.weight.contiguous(),
            f"{prefix}.weights_scaling_factor": lin.scale.to(f32).reshape(-1).contiguous(),
            f"{prefix}.activation_scaling_factor": act,
            f"{prefix}.prequant_scaling_factor": (
                pqs if pqs is not None else torch.ones(lin.in_features)
            ).to(dtype),
        }
    # W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN
    out = {
        f"{prefix}.weight": lin.weight.contiguous(),
        f"{prefix}.per_channel_scale": lin.scale.to(f32).reshape(1, -1).contiguous(),
    }
    if role == "row":
        smoother = 1 / pqs if pqs is not None else torch.ones(lin.in_features)
        out[f"{prefix}.smoother"] = smoother.to(f32).reshape(1, -1).contiguous()
    elif pqs is not None and not torch.all(pqs == 1):
        raise UsageError(
            f"{prefix}: the SmoothQuant plugin layout folds a column linear's "
            "smoothing into the norm; this checkpoint kept it separate"
        )
    return out


def expert_tensors(
    src: Source, layer: Layer, algo: str, tp: int, rank: int, dtype: torch.dtype, notes: list[str]
) -> dict[str, torch.Tensor]:
    """Sparse layer `layer`'s MoE tensors on one rank (layers/moe.py MixtureOfExperts): the
    float32 router (num_experts, hidden), whole on every rank; `mlp.fc` stacking each
    expert's [up; gate] rows of this rank (experts, 2 × width / tp, hidden) and `mlp.proj`
    each expert's down columns (experts, hidden, width / tp). FP8: one weight scale per
    expert and GEMM (up and gate re-quantised to the larger of theirs) and one activation
    scale per GEMM, the largest of the experts'."""
    prefix = f"transformer.layers.{layer.index}.mlp"
    assert layer.router is not None
    out = {f"{prefix}.router.weight": layer.router.to(torch.float32).contiguous()}
    fcs, projs = [], []
    for e, (gate, up, down) in enumerate(src.experts(layer)):
        halves = [shard(w, "column", tp, rank) for w in (up, gate)]
        fcs.append(fuse_linears(halves, algo, notes, f"layer {layer.index} expert {e} gate_up"))
        projs.append(shard(down, "row", tp, rank))
    for name, linears in (("fc", fcs), ("proj", projs)):
        if algo != "FP8":  # float, or float weights trtllm-build quantises per channel
            out[f"{prefix}.{name}.weight"] = torch.stack(
                [float_weight(w, dtype) for w in linears]
            ).contiguous()
            continue
        scales = [w.input_scale for w in linears if w.input_scale is not None]
        act = torch.stack(scales).max() if scales else torch.ones(())
        if scales and not all(torch.equal(s, scales[0]) for s in scales):
            notes.append(f"layer {layer.index} experts' {name}: one FP8 activation scale for "
                         "all experts, the largest of theirs")  # fmt: skip
        out[f"{prefix}.{name}.weight"] = torch.stack([w.weight for w in linears]).contiguous()
        out[f"{prefix}.{name}.weights_scaling_factor"] = torch.stack(
            [w.scale.reshape(-1)[:1] for w in linears if w.scale is not None]
        ).to(torch.float32)
        out[f"{prefix}.{name}.activation_scaling_factor"] = act.to(torch.float32).reshape(1)
    return out
