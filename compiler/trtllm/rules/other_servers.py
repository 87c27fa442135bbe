"""Where an artifact serves when no TensorRT-LLM path carries it: kiln serve (its runtime runs
every scheme kiln writes), and vLLM as far as vLLM's kernels go.

vLLM runs a mixture of experts' weight-only int experts (its "WNA16" MoE) with Marlin or Triton
kernels on CUDA; its CPU build picks only CPUExpertsInt4, int4 weights alone, which needs an x86
CPU with AMX tiles (`torch.cpu._is_amx_tile_supported()`, Sapphire Rapids or later); elsewhere
it stops with "No WNA16 MoE backend supports the deployment configuration"
(vllm/model_executor/layers/fused_moe/oracle/wna16.py, experts/cpu_moe.py).
"""

from __future__ import annotations

from kiln.runtime.formats.model_info import ModelInfo

# TensorRT-LLM QuantAlgos of int weight-only schemes, by weight width.
WEIGHT_ONLY_INT4 = frozenset({"W4A16", "W4A16_AWQ", "W4A16_GPTQ"})
WEIGHT_ONLY_INT8 = frozenset({"W8A16", "W8A16_GPTQ"})


def serves_elsewhere(info: ModelInfo | None, algo: str) -> str:
    """What a recipe can do instead of a TensorRT-LLM target: `targets: []`, and where the
    artifact of `info` quantised to QuantAlgo `algo` then serves."""
    if info is not None and info.moe is not None and algo in WEIGHT_ONLY_INT4:
        where = ("kiln serve, and vLLM on CUDA GPUs; vLLM's CPU build runs int4 MoE experts only "
                 "on x86 CPUs with AMX")  # fmt: skip
    elif info is not None and info.moe is not None and algo in WEIGHT_ONLY_INT8:
        where = "kiln serve, and vLLM on CUDA GPUs (vLLM's CPU build has no int8 weight-only MoE)"
    else:
        where = "kiln serve and vLLM"
    return f"targets: [] (the artifact serves on {where})"
