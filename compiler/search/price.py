"""What a candidate costs to serve on a GPU target, modelled from the planner's numbers
(compiler/trtllm/capacity.py `plan`): at the recipe's traffic shape — `deploy.max_batch_size`
sequences at `max_seq_len`, as many as the KV cache holds — one decode step reads the
weights once and each sequence's KV at the mean context, or is bound by the tensor cores of
the scheme's GEMMs (2 FLOPs a parameter a token; int8 and FP8 at the FP8 rate, FP4 at FP4's,
weight-only schemes at bf16's), whichever is slower. Output tokens/s per deployment follow,
and with `deploy.gpu_price_per_hour` the price of a million output tokens; without one, the
GPU-hours per million (a price of 1 an hour). Always labelled as modelled: no GPU measures it
here. Hand-written: no library prices a TensorRT-LLM deployment of a quantised model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.compiler.trtllm.capacity import DeploySpec, cost_per_million, plan
from kiln.compiler.trtllm.targets import TargetProfile
from kiln.quant.spec import Scheme
from kiln.runtime.formats.model_info import ModelInfo

FP8_RATE = frozenset(
    {
        "FP8",
        "FP8_PER_CHANNEL_PER_TOKEN",
        "FP8_BLOCK_SCALES",
        "W4A8_AWQ",
        "W8A8_SQ_PER_CHANNEL",
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
    }
)
FP4_RATE = frozenset({"NVFP4"})


@dataclass(frozen=True, slots=True)
class Price:
    """One candidate on one target, modelled."""

    target: str
    fits: bool
    tp_size: int
    gpus: int
    batch: int  # sequences decoded together at the traffic shape
    max_concurrency: int  # sequences of max_seq_len the KV cache holds
    weight_bytes_per_gpu: int
    decode_bound_tokens_per_s: float  # one sequence, memory bound
    tokens_per_s: float  # the deployment's output tokens/s at `batch`
    bound: str  # memory | compute
    per_million_tokens: float | None  # in the recipe's currency, or GPU-hours
    unit: str  # "$/M output tokens" or "GPU-hours/M output tokens"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "source": "modelled"}


def peak_flops(algo: str, target: TargetProfile) -> float:
    """Dense tensor FLOP/s of the GEMMs `algo` runs on `target`."""
    bf16 = target.bf16_tflops * 1e12
    if algo in FP4_RATE and target.fp4_tflops:
        return target.fp4_tflops * 1e12
    if algo in FP8_RATE:
        return (target.fp8_tflops or 2 * target.bf16_tflops) * 1e12  # int8 = 2x bf16 pre-FP8
    return bf16


def active_parameters(info: ModelInfo) -> int:
    """Parameters one token multiplies: every decoder linear it uses and the LM head."""
    linears = sum(o * i for n in range(info.num_layers) for o, i in info.active_linears(n).values())
    return linears + info.vocab_size * info.hidden_size


def price(info: ModelInfo, scheme: Scheme, target: TargetProfile, deploy: DeploySpec) -> Price:
    p = plan(info, scheme, target, deploy)
    batch = max(1, min(deploy.max_batch_size, p.max_concurrent_sequences))
    bandwidth = target.memory_bandwidth_gb_s * 1e9
    read = p.decode_weight_read_bytes_per_gpu + batch * p.decode_kv_read_bytes_per_sequence_per_gpu
    memory_s = read / bandwidth
    compute_s = 2 * active_parameters(info) / p.tp_size * batch / peak_flops(p.quant_algo, target)
    step = max(memory_s, compute_s)
    tokens_per_s = batch / step if p.fits else 0.0
    gpus = p.num_gpus
    hourly = deploy.gpu_price_per_hour or 1.0
    per_million = cost_per_million(hourly, gpus, tokens_per_s) if tokens_per_s > 0 else None
    unit = "$/M output tokens" if deploy.gpu_price_per_hour else "GPU-hours/M output tokens"
    return Price(
        target=target.name,
        fits=p.fits,
        tp_size=p.tp_size,
        gpus=gpus,
        batch=batch,
        max_concurrency=p.max_concurrent_sequences,
        weight_bytes_per_gpu=p.weight_bytes_per_gpu,
        decode_bound_tokens_per_s=p.decode_tokens_per_s_bound,
        tokens_per_s=tokens_per_s,
        bound="memory" if memory_s >= compute_s else "compute",
        per_million_tokens=per_million,
        unit=unit,
    )
