"""Bytes of each checkpoint a compile writes, from the model's shapes and the resolved scheme:
the float source, the quantised Hugging Face checkpoint (packed codes with their scales and zero
points), the quantiser's offload while calibrating, the TensorRT-LLM checkpoint per tensor
parallel size, the report. Upper bounds: scales and zero points count 4 bytes each. Measured
against what kiln writes: each stage of SmolLM2-135M (GPTQ W4A16) within 2% above, and the kept
total of 16M-parameter Llamas (FP8, FP8 rowwise, AWQ, GPTQ, SmoothQuant, NVFP4, W4A8, float)
within 1-2% above.
"""

from __future__ import annotations

import math

from kiln.compiler.trtllm.rules.checkpoint import CHECKPOINT_ALGO
from kiln.compiler.trtllm.rules.exclusions import padded_features
from kiln.quant.selection import quantised_linears
from kiln.quant.spec import Scheme
from kiln.runtime.formats.model_info import ModelInfo

SLACK = 64 << 10  # per stage and per checkpoint: stage.json, configs, file-system blocks
SCALE = 4  # bytes per scale or zero point: float32, the widest any writer uses
EXPORT_FLOAT = 2  # the TensorRT-LLM checkpoint's float dtype (bfloat16)
INT4_AWQ = ("W4A16_AWQ", "W4A8_AWQ")
FLOAT_EXPORTS = ("NO_QUANT", "W8A16", "W4A16")  # written dequantised (trtllm-build quantises)
UPDATES_WEIGHTS = ("gptq", "awq", "smoothquant")  # methods that write float weights back


def biases(info: ModelInfo) -> int:
    """Parameters of the q/k/v biases (Qwen2), which `num_parameters` leaves out."""
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    return info.num_layers * (q + 2 * kv) if info.qkv_bias else 0


def float_bytes(info: ModelInfo, width: int) -> int:
    """The whole model in float of `width` bytes."""
    return (info.num_parameters + biases(info)) * width


def all_linears(info: ModelInfo) -> dict[str, tuple[int, int]]:
    """Every linear by full module name, the LM head and a MoE's routers included."""
    out = {
        f"model.layers.{layer}.{name}": shape
        for layer in range(info.num_layers)
        for name, shape in info.layer_linears(layer).items()
    }
    out["lm_head"] = (info.vocab_size, info.hidden_size)
    return out


def _quantised(info: ModelInfo, scheme: Scheme) -> dict[str, tuple[int, int]]:
    return {} if scheme.name == "NO_QUANT" else quantised_linears(info, scheme.spec.ignore)


def hf_checkpoint_bytes(info: ModelInfo, scheme: Scheme, width: int) -> int:
    """The quantised Hugging Face checkpoint's tensors: quantised linears in their packed
    codes with scales (and zero points), everything else float of `width` bytes."""
    quantised = _quantised(info, scheme)
    stored = {n: s for n, s in quantised.items() if n != "lm_head" or not info.tie_word_embeddings}
    floats = float_bytes(info, width) - width * sum(o * i for o, i in stored.values())
    kv_scales = info.num_layers * 2 * SCALE if scheme.kv_cache != "none" else 0
    return floats + sum(_hf_linear(o, i, scheme) for o, i in quantised.values()) + kv_scales


def _hf_linear(out: int, inp: int, scheme: Scheme) -> int:
    codes = math.ceil(out * inp * scheme.weight_bits / 8)
    if scheme.name == "NVFP4":  # FP8 scales per 16 inputs
        scales = out * math.ceil(inp / 16)
    else:
        per_row = math.ceil(inp / scheme.group_size) if scheme.group_size else 1
        scales = out * per_row * SCALE * (1 if scheme.symmetric else 2)
    # pre-quant (smoothing) scales per input, and per-tensor input and weight scales
    return codes + scales + inp * SCALE + 4 * SCALE


def offload_bytes(info: ModelInfo, scheme: Scheme, width: int) -> int:
    """Bound of the quantiser's offload while calibrating: the linears it quantises, in float
    where the method updates weights (GPTQ, and AWQ and SmoothQuant smoothing them), else as
    compressed; the norms it smooths; and a mixture of experts' experts twice more in float, as
    llm-compressor splits the fused expert tensors into linears. Measured: SmolLM2 GPTQ 1.0×
    its float linears, a 16M Llama FP8 0.93× its FP8 linears, tiny Mixtral FP8 0.87× this."""
    quantised = _quantised(info, scheme)
    if scheme.method in UPDATES_WEIGHTS:
        linears = width * sum(o * i for o, i in quantised.values())
    else:
        linears = sum(_hf_linear(o, i, scheme) for o, i in quantised.values())
    experts = sum(o * i for n, (o, i) in all_linears(info).items() if ".experts." in n)
    norms = info.num_layers * info.hidden_size * 4
    return linears + (2 * experts + norms) * width


def export_bytes(info: ModelInfo, scheme: Scheme, tp: int) -> int:
    """The TensorRT-LLM checkpoint for tensor parallel `tp`, all ranks: each linear in the
    exported layout (group-wise ones padded), q/k/v rows of replicated KV heads counted on
    every rank holding them, the LM head padded to a multiple of `tp`, and the embedding,
    norms and routers on every rank. Nothing where the scheme has no export."""
    algo = CHECKPOINT_ALGO.get(scheme.trtllm_quant_algo)
    if algo is None:
        return 0
    quantised = _quantised(info, scheme)
    kv_copies = max(1, tp // info.num_kv_heads)  # a KV head on each rank that needs it
    total = 0
    for name, (out, inp) in all_linears(info).items():
        short = name.rsplit(".", 1)[-1]
        if info.moe is not None and short == info.moe.router:
            total += tp * out * inp * 4  # float32 on every rank
            continue
        if short in ("k_proj", "v_proj"):
            out *= kv_copies
        elif short == "qkv_proj":
            q = info.num_heads * info.head_dim
            out = q + (out - q) * kv_copies
        elif name == "lm_head":
            out = math.ceil(out / tp) * tp
        if ".experts." in name:  # stacked per layer: FP8 as is, the rest float
            total += out * inp * (1 if algo == "FP8" else EXPORT_FLOAT)
        elif name in quantised and algo not in FLOAT_EXPORTS:
            total += _trt_linear(out, inp, algo, scheme, tp)
        else:
            total += out * inp * EXPORT_FLOAT
    norms = info.num_layers * (info.hidden_size * (4 if info.gemma else 2) + 2 * info.head_dim)
    replicated = info.vocab_size * info.hidden_size + norms + info.hidden_size
    return (
        total
        + biases(info) * EXPORT_FLOAT * kv_copies
        + tp * (replicated * EXPORT_FLOAT + info.num_layers * 4 * SCALE)
    )


def _trt_linear(out: int, inp: int, algo: str, scheme: Scheme, tp: int) -> int:
    """One quantised linear, all ranks, in the TensorRT-LLM checkpoint's layout."""
    if algo in INT4_AWQ:
        group = scheme.group_size or inp
        out = padded_features(out, group, tp, w4a8=algo == "W4A8_AWQ")
        inp = padded_features(inp, group, tp, w4a8=algo == "W4A8_AWQ")
        groups = out * math.ceil(inp / group)
        zeros = groups * EXPORT_FLOAT if not scheme.symmetric else 0
        return out * inp // 2 + groups * SCALE + zeros + tp * inp * EXPORT_FLOAT + 4 * SCALE
    if algo == "NVFP4":
        return out * inp // 2 + out * math.ceil(inp / 16) + tp * 3 * SCALE
    # FP8, FP8 rowwise and SmoothQuant: a byte a weight, per-channel and per-input scales
    return out * inp + out * SCALE + tp * (inp + 2) * SCALE


def report_bytes(info: ModelInfo) -> int:
    """quantization.json: a few numbers per linear."""
    return SLACK + 1024 * len(all_linears(info))
