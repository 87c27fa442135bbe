"""How much host memory calibration needs, estimated from shapes before any weight loads."""

from __future__ import annotations

from kiln.quant.backends import BACKENDS
from kiln.quant.selection import quantised_linears
from kiln.quant.spec import DTYPE_BYTES, CalibrationSpec, Scheme, calibration_dtype
from kiln.runtime.formats.model_info import ModelInfo

__all__ = ["DTYPE_BYTES", "calibration_dtype", "estimate_calibration_bytes"]

FP32 = 4


# Python with torch, transformers, datasets and llm-compressor imported: 526 MiB resident
# (measured, CPU build of torch 2.13), before any model loads.
RUNTIME_BYTES = 550 * 2**20
SHARD_BYTES = 5 * 10**9  # a saved checkpoint's shard (backends/base.py SHARD_SIZE)


def estimate_calibration_bytes(
    info: ModelInfo, scheme: Scheme, calib: CalibrationSpec
) -> dict[str, int]:
    """Peak host bytes of calibrating `info` with `spec` on `calib`, by component.

    Basis (llm-compressor's sequential pipeline on CPU; ModelOpt is no larger for the
    schemes it does, since it calibrates batch by batch):
    - weights: for a scheme its backend calibrates offloaded (llm-compressor's; ModelOpt's
      FP8 and NVFP4), one decoder layer onloaded in the checkpoint's float dtype and its
      compressed copy, the embeddings, or one saved shard (5 GB at most), whichever is
      larger; for one that needs the model in memory (ModelOpt's AWQ and SmoothQuant), every
      parameter in that dtype; plus one fp32 copy of the largest linear's weight for
      quantise/compress scratch;
    - activations: the layer-input cache the sequential pipeline keeps for all samples
      (num_samples × max_seq_len × hidden, held twice: inputs and outputs of the layer being
      calibrated), plus one sample's pass through a layer (q/k/v, attention scores per head,
      MLP intermediates);
    - hessians (GPTQ and SmoothQuant+GPTQ): in_features² fp32 per quantised linear of one
      decoder layer;
    - awq: cached inputs of each smoothed group (qkv, gate/up, down) for all samples, plus
      the layer's fp32 output kept as the loss target;
    - runtime: the Python process with torch and the libraries imported;
    - total: the sum. Expect the real peak within about ±30%. Measured on SmolLM2-135M fp32,
      GPTQ W4A16 g64: 64 × 256 tokens peaked at 1277 MiB RSS (estimate 1166 MiB), 32 × 128
      at 1429 MiB (estimate 1105 MiB).
    """
    tokens = calib.num_samples * calib.max_seq_len
    hidden, inter = info.hidden_size, info.intermediate_size
    spec = scheme.spec
    method, calibrated = scheme.method, scheme.needs_calibration
    linears = quantised_linears(info, spec.ignore)
    largest = max((o * i for o, i in linears.values()), default=0)
    weight_bytes = DTYPE_BYTES[calibration_dtype(info.torch_dtype)]
    weights = info.num_parameters * weight_bytes + largest * FP32
    if BACKENDS[spec.backend].offloads_for(scheme.name):
        layer = max((sum(o * i for o, i in info.layer_linears(n).values())
                     for n in range(info.num_layers)), default=0)  # fmt: skip
        embeddings = info.vocab_size * info.hidden_size * (1 if info.tie_word_embeddings else 2)
        shard = min(SHARD_BYTES, info.num_parameters * weight_bytes)
        resident = max(2 * layer * weight_bytes + embeddings * weight_bytes, shard)
        weights = resident + largest * FP32

    activations = 0
    if calibrated:
        seq = calib.max_seq_len
        q_out = info.num_heads * info.head_dim
        kv_out = info.num_kv_heads * info.head_dim
        one_pass = seq * (hidden * 4 + q_out + 2 * kv_out + 3 * inter) + info.num_heads * seq * seq
        activations = (2 * tokens * hidden + one_pass) * FP32

    hessians = 0
    if method in ("gptq", "smoothquant"):
        layer0 = {n: s for n, s in linears.items() if n.startswith("model.layers.0.")}
        hessians = sum(i * i for _, i in layer0.values()) * FP32

    awq = 0
    if method == "awq":
        awq = tokens * (hidden + hidden + inter + hidden) * FP32

    parts = {
        "weights": weights,
        "activations": activations,
        "hessians": hessians,
        "awq": awq,
        "runtime": RUNTIME_BYTES,
    }
    parts["total"] = sum(parts.values())
    return parts
