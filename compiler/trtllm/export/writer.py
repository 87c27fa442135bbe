"""Write a TensorRT-LLM unified checkpoint (`config.json` + `rank{N}.safetensors`).

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

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kiln.compiler.trtllm.export.checkpoint_config import checkpoint_config
from kiln.compiler.trtllm.export.linears import (
    fuse_linears,
    head_rows,
    pack_int4_rows,
    pad_groupwise,
    pad_linear,
    shard,
)
from kiln.compiler.trtllm.export.source import GEMMA_NORMS, QK_NORMS, Source, read_source
from kiln.compiler.trtllm.rules.checkpoint import CHECKPOINT_ALGO, NOT_EXPORTED
from kiln.compiler.trtllm.rules.exclusions import (
    NO_EXCLUSIONS,
    ROWWISE,
    exclude_modules,
    rowwise_exclude_modules,
)
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.weights import LinearWeights, effective_weight

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
INT4_AWQ = ("W4A16_AWQ", "W4A8_AWQ")  # ModelOpt's packed int4 layout
FLOAT_WEIGHTS = ("NO_QUANT", "W8A16", "W4A16")  # trtllm-build quantises these itself
# HF projection → (TensorRT-LLM module, tensor-parallel role)
MODULES = {
    "o_proj": ("attention.dense", "row"),
    "gate_proj": ("mlp.fc", "column"),
    "up_proj": ("mlp.gate", "column"),
    "down_proj": ("mlp.proj", "row"),
}
# The linears of each block FP8 rowwise swaps whole (exclusions.ROWWISE_BLOCKS).
BLOCK_LINEARS = {"attention": ("qkv", "dense"), "mlp": ("fc", "gate", "proj")}


def _bias(prefix: str, lin: LinearWeights, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A linear's bias tensor (Qwen2's q/k/v), if it has one."""
    return {} if lin.bias is None else {f"{prefix}.bias": lin.bias.to(dtype).contiguous()}


def _tensors(
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
        return {f"{prefix}.weight": effective_weight(lin, dtype).contiguous()}
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
    a record for the manifest: the checkpoint's quant algos, tp, files and notes.
    """
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: use {' or '.join(DTYPES)}")
    src = read_source(Path(model_dir), quant_algo)
    if src.quant_algo in NOT_EXPORTED:
        raise UsageError(f"{src.quant_algo}: {NOT_EXPORTED[src.quant_algo]}")
    if src.quant_algo not in CHECKPOINT_ALGO:
        raise UsageError(f"{src.quant_algo} has no TensorRT-LLM checkpoint export")
    info, algo, torch_dtype = src.info, CHECKPOINT_ALGO[src.quant_algo], DTYPES[dtype]
    tp = tp_size
    width = info.moe_intermediate_size if info.moe is not None else info.intermediate_size
    if tp < 1 or (
        info.num_heads % tp or (info.num_kv_heads % tp and tp % info.num_kv_heads) or width % tp
    ):
        raise UsageError(
            f"tp_size {tp} does not split {info.num_heads} heads, {info.num_kv_heads} KV heads "
            f"and {width} MLP columns"
        )
    pre_quant = algo == "W4A8_AWQ" or (
        algo == "W4A16_AWQ" and any(lin.pre_quant_scale is not None for lin in src.linears.values())
    )
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
    if algo in float_head and src.linears["lm_head"].scale is not None:
        notes.append(
            f"{algo}: lm_head stays in {dtype} (TensorRT-LLM runs it in float under {algo})"
        )
    quantised_head = algo not in float_head and src.linears["lm_head"].scale is not None
    if algo == ROWWISE:
        exclude = rowwise_exclude_modules(_float_blocks(excluded))
    else:
        exclude = exclude_modules(excluded, algo, lm_head_quantised=quantised_head)
    modules = _modules(src)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for rank in range(tp):
        tensors = _rank_tensors(
            src, modules, algo, tp, rank, torch_dtype, pre_quant, notes if rank == 0 else []
        )
        path = out_dir / f"rank{rank}.safetensors"
        save_file(tensors, str(path))
        files.append(path.name)
    config = checkpoint_config(src, algo, tp, dtype, pre_quant, exclude)
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
            src.linears[f"model.layers.{i}.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")
        ]
        if len({lin.scale is None for lin in qkv}) > 1:
            raise UsageError(
                f"layer {i}: q, k and v must be all quantised or all ignored "
                "(TensorRT-LLM fuses them)"
            )
        if qkv[0].scale is None:
            names.append(f"transformer.layers.{i}.attention.qkv")
        for hf, trt in _layer_modules(src, i).items():
            if src.linears[hf].scale is None:
                names.append(trt)
        if i in src.routers:  # layers/moe.py: the router is never quantised
            names.append(f"transformer.layers.{i}.mlp.router")
            _check_experts(src, i)
    return names


def _check_experts(src: Source, layer: int) -> None:
    """UsageError where some experts of a quantised checkpoint are float: TensorRT-LLM's MoE
    layer runs all experts of a layer in one format."""
    if src.quant_algo == "NO_QUANT":
        return
    float_experts = [
        e for e, linears in enumerate(src.experts(layer)) if any(w.scale is None for w in linears)
    ]
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
    if layer in src.routers:
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


def _weight_globals(src: Source) -> dict[str, torch.Tensor]:
    """NVFP4: TensorRT-LLM module → its per-tensor weight scale (q/k/v: the largest of the
    three, as TensorRT-LLM's own loader takes for its fused qkv)."""
    found, out = src.weight_globals, {}
    for i in range(src.info.num_layers if found else 0):
        hf, trt = f"model.layers.{i}", f"transformer.layers.{i}"
        names = [f"{hf}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        if all(n in found for n in names):
            out[f"{trt}.attention.qkv"] = torch.stack([found[n] for n in names]).max()
        gate_up = [f"{hf}.mlp.{p}" for p in ("gate_proj", "up_proj")]
        if src.info.fused_projections and all(n in found for n in gate_up):
            out[f"{trt}.mlp.fc"] = torch.stack([found[n] for n in gate_up]).max()
        for name, module in _layer_modules(src, i).items():
            if name in found:
                out[module] = found[name]
    if "lm_head" in found:
        out["lm_head"] = found["lm_head"]
    return out


def _modules(src: Source) -> dict[str, tuple[LinearWeights, str]]:
    """TensorRT-LLM module name → (whole linear, tp role); q/k/v are fused per rank later."""
    out: dict[str, tuple[LinearWeights, str]] = {"lm_head": (src.linears["lm_head"], "column")}
    for i in range(src.info.num_layers):
        for hf, trt in _layer_modules(src, i).items():
            out[trt] = (src.linears[hf], MODULES[hf.rpartition(".")[2]][1])
    return out


def _rank_tensors(
    src: Source,
    modules: dict[str, tuple[LinearWeights, str]],
    algo: str,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    pre_quant: bool,
    notes: list[str],
) -> dict[str, torch.Tensor]:
    info, zero_point = src.info, not src.symmetric
    globals_ = _weight_globals(src)

    def norm(key: str) -> torch.Tensor:
        # Gemma 3 computes x·(1 + w); TensorRT-LLM's RmsNorm x·w (models/gemma/convert.py
        # adds the one, in float32).
        weight = src.tensors[key]
        return (weight.float() + 1 if info.gemma else weight).to(dtype)

    def linear(prefix: str, lin: LinearWeights, role: str) -> None:
        out.update(_tensors(prefix, lin, algo, role, dtype, pre_quant, zero_point,
                            globals_.get(prefix)))  # fmt: skip
        out.update(_bias(prefix, lin, dtype))

    out: dict[str, torch.Tensor] = {
        "transformer.vocab_embedding.weight": src.tensors["model.embed_tokens.weight"].to(dtype),
        "transformer.ln_f.weight": norm("model.norm.weight"),
    }
    for name, (lin, role) in modules.items():
        if name == "lm_head" and lin.out_features % tp:
            lin = pad_linear(lin, -(-lin.out_features // tp) * tp, lin.in_features)
        linear(name, pad_groupwise(shard(lin, role, tp, rank), algo, role, tp), role)
    for i in range(info.num_layers):
        prefix, layer = f"model.layers.{i}", f"transformer.layers.{i}"
        parts = [
            src.linears[f"{prefix}.self_attn.{p}"].rows(head_rows(heads, info.head_dim, tp, rank))
            for p, heads in (
                ("q_proj", info.num_heads),
                ("k_proj", info.num_kv_heads),
                ("v_proj", info.num_kv_heads),
            )
        ]
        qkv = pad_groupwise(fuse_linears(parts, algo, notes, f"layer {i} qkv"), algo, "column", tp)
        linear(f"{layer}.attention.qkv", qkv, "column")
        if info.fused_projections:
            # models/phi3: one fc of [up; gate] rows (swiglu gates with the second half), each
            # rank holding its own rows of both halves.
            halves = [shard(src.linears[f"{prefix}.mlp.{p}"], "column", tp, rank)
                      for p in ("up_proj", "gate_proj")]  # fmt: skip
            fc = fuse_linears(halves, algo, notes, f"layer {i} gate_up")
            linear(f"{layer}.mlp.fc", pad_groupwise(fc, algo, "column", tp), "column")
        if i in src.routers:
            out.update(_expert_tensors(src, i, algo, tp, rank, dtype, notes))
        out[f"{layer}.input_layernorm.weight"] = norm(f"{prefix}.input_layernorm.weight")
        out[f"{layer}.post_layernorm.weight"] = norm(f"{prefix}.post_attention_layernorm.weight")
        for gemma_norm in GEMMA_NORMS if info.gemma else ():
            out[f"{layer}.{gemma_norm}.weight"] = norm(f"{prefix}.{gemma_norm}.weight")
        for qk in QK_NORMS if info.qk_norm else ():
            # models/qwen/convert.py, models/gemma/convert.py: q_norm / k_norm load as
            # attention.{q,k}_layernorm, float.
            out[f"{layer}.attention.{qk[0]}_layernorm.weight"] = norm(
                f"{prefix}.self_attn.{qk}.weight"
            )
        if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
            for plugin_norm in ("input_layernorm", "post_layernorm"):
                out[f"{layer}.{plugin_norm}.scale_to_int"] = torch.ones(1, dtype=dtype)
        if i in src.kv_scales:
            out[f"{layer}.attention.kv_cache_scaling_factor"] = src.kv_scales[i].reshape(1)
    return out


def _expert_tensors(
    src: Source, layer: int, algo: str, tp: int, rank: int, dtype: torch.dtype, notes: list[str]
) -> dict[str, torch.Tensor]:
    """Sparse layer `layer`'s MoE tensors on one rank (layers/moe.py MixtureOfExperts): the
    float32 router (num_experts, hidden), whole on every rank; `mlp.fc` stacking each
    expert's [up; gate] rows of this rank (experts, 2 × width / tp, hidden) and `mlp.proj`
    each expert's down columns (experts, hidden, width / tp). FP8: one weight scale per
    expert and GEMM (up and gate re-quantised to the larger of theirs) and one activation
    scale per GEMM, the largest of the experts'."""
    prefix = f"transformer.layers.{layer}.mlp"
    out = {f"{prefix}.router.weight": src.routers[layer].to(torch.float32).contiguous()}
    fcs, projs = [], []
    for e, (gate, up, down) in enumerate(src.experts(layer)):
        halves = [shard(w, "column", tp, rank) for w in (up, gate)]
        fcs.append(fuse_linears(halves, algo, notes, f"layer {layer} expert {e} gate_up"))
        projs.append(shard(down, "row", tp, rank))
    for name, linears in (("fc", fcs), ("proj", projs)):
        if algo != "FP8":  # float, or float weights trtllm-build quantises per channel
            out[f"{prefix}.{name}.weight"] = torch.stack(
                [effective_weight(w, dtype) for w in linears]
            ).contiguous()
            continue
        scales = [w.input_scale for w in linears if w.input_scale is not None]
        act = torch.stack(scales).max() if scales else torch.ones(())
        if scales and not all(torch.equal(s, scales[0]) for s in scales):
            notes.append(f"layer {layer} experts' {name}: one FP8 activation scale for all "
                         "experts, the largest of theirs")  # fmt: skip
        out[f"{prefix}.{name}.weight"] = torch.stack([w.weight for w in linears]).contiguous()
        out[f"{prefix}.{name}.weights_scaling_factor"] = torch.stack(
            [w.scale.reshape(-1)[:1] for w in linears if w.scale is not None]
        ).to(torch.float32)
        out[f"{prefix}.{name}.activation_scaling_factor"] = act.to(torch.float32).reshape(1)
    return out
