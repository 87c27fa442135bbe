"""GPU target profiles and the TensorRT-LLM quantisation × GPU support matrix.

A profile is data: adding a GPU means adding one `TargetProfile` to `PROFILES`; what it
can run comes from its compute-capability family in `SUPPORT`.

Figures and their sources:
- `memory_gb` is the datasheet label (decimal GB as NVIDIA prints it); `memory_mib` is the
  total the driver reports (nvidia-smi "Memory-Usage" total, MiB = 2**20 bytes), which is
  what the planner divides up. The MiB totals were read from published nvidia-smi output.
- Bandwidth (GB/s = 1e9 B/s) and tensor TFLOPS are NVIDIA datasheet figures, dense (the
  datasheets' headline figures are with 2:4 sparsity, twice these). None: no such tensor
  cores.
- `nvlink_gb_s` is the total NVLink bandwidth per GPU; None for PCIe-only parts (H100 PCIe
  takes an optional 2-way bridge; we plan it as PCIe).

Support matrix (`SUPPORT`), per path:
- pytorch: TensorRT-LLM's PyTorch backend (`trtllm-serve`, HF quantised checkpoints), from
  its docs' hardware matrix (docs/source/features/quantization.md): Blackwell sm100/103
  NVFP4, FP8 per-tensor and block, FP8 KV, no INT4 weight-only, no W4A8; sm120 NVFP4, FP8
  per-tensor, FP8 KV; Hopper FP8 (per-tensor, block, rowwise), W4A8 AWQ, W4A16 AWQ/GPTQ;
  Ada FP8 per-tensor, W4A8 AWQ, W4A16 AWQ/GPTQ; Ampere W4A16 AWQ/GPTQ; FP8 KV everywhere.
  Per-channel INT8/INT4 weight-only (W8A16, W4A16) runs through its
  `WeightOnlyQuantLinearMethod` on sm80-sm90. No INT8 SmoothQuant, no INT8 KV cache.
- engine: TensorRT-LLM 1.2.x `trtllm-build`. Weight-only INT8/INT4 (per channel and
  groupwise), INT8 SmoothQuant and INT8 KV run on sm80+; FP8 and W4A8 AWQ need sm89+
  ("INT4 AWQ and GPTQ with FP8 activations require SM >= 89"); FP8 rowwise has sm89/sm90
  kernels only (trtllm-build refuses `fp8_rowwise_gemm_plugin` on sm100); NVFP4 is
  Blackwell only. On Blackwell (SM 100-119) the builder itself (tensorrt_llm/builder.py
  `build`) raises for INT8/INT4 weight-only, SmoothQuant, per-channel/per-token scaling and
  INT8 KV, so the engine row there holds only NO_QUANT, FP8 and NVFP4 with an FP8 KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.runtime.base.errors import UsageError

PATHS = ("engine", "pytorch")
PATH_LABELS = {
    "engine": "engine path (TensorRT-LLM 1.2.x trtllm-build)",
    "pytorch": "PyTorch path (trtllm-serve)",
}

WEIGHT_ONLY = frozenset({"W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W8A16_GPTQ"})
SMOOTHQUANT = frozenset(
    {
        "W8A8_SQ_PER_CHANNEL",
        "W8A8_SQ_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN",
        "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
    }
)


@dataclass(frozen=True, slots=True)
class ArchSupport:
    """What TensorRT-LLM runs on one compute-capability family, per path."""

    family: str
    engine_quant: frozenset[str]
    engine_kv: frozenset[str]
    pytorch_quant: frozenset[str]
    pytorch_kv: frozenset[str]


_AMPERE_ENGINE = frozenset({"NO_QUANT"}) | WEIGHT_ONLY | SMOOTHQUANT
_ADA_ENGINE = _AMPERE_ENGINE | {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W4A8_AWQ"}
_AMPERE_PYTORCH = frozenset({"NO_QUANT", "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ"})
_ADA_PYTORCH = _AMPERE_PYTORCH | {"FP8", "W4A8_AWQ"}

SUPPORT: dict[str, ArchSupport] = {
    "sm80": ArchSupport("Ampere", _AMPERE_ENGINE, frozenset({"INT8", "FP8"}),
                        _AMPERE_PYTORCH, frozenset({"FP8"})),
    "sm89": ArchSupport("Ada Lovelace", _ADA_ENGINE, frozenset({"INT8", "FP8"}),
                        _ADA_PYTORCH, frozenset({"FP8"})),
    "sm90": ArchSupport("Hopper", _ADA_ENGINE, frozenset({"INT8", "FP8"}),
                        _ADA_PYTORCH | {"FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES"},
                        frozenset({"FP8"})),
    "sm100": ArchSupport("Blackwell", frozenset({"NO_QUANT", "FP8", "NVFP4"}),
                         frozenset({"FP8"}),
                         frozenset({"NO_QUANT", "FP8", "FP8_BLOCK_SCALES", "NVFP4"}),
                         frozenset({"FP8", "NVFP4"})),
    "sm120": ArchSupport("Blackwell (sm120)", frozenset({"NO_QUANT", "FP8", "NVFP4"}),
                         frozenset({"FP8"}), frozenset({"NO_QUANT", "FP8", "NVFP4"}),
                         frozenset({"FP8"})),
}  # fmt: skip


def family_of(compute_capability: tuple[int, int]) -> str:
    """The `SUPPORT` key of a compute capability: (8, 6) → sm80, (10, 3) → sm100."""
    major, minor = compute_capability
    if major == 8:
        return "sm89" if minor == 9 else "sm80"
    return f"sm{major}0"


@dataclass(frozen=True, slots=True)
class TargetProfile:
    """One GPU model: memory, bandwidth, dense tensor throughput and what TRT-LLM runs on it."""

    name: str
    marketing_name: str
    compute_capability: tuple[int, int]
    memory_gb: float  # datasheet label, decimal GB
    memory_mib: int  # total reported by the driver, MiB (2**20 B)
    memory_bandwidth_gb_s: float  # 1e9 B/s
    bf16_tflops: float  # dense
    fp8_tflops: float | None  # dense; None: no FP8 tensor cores
    fp4_tflops: float | None  # dense; None: no FP4 tensor cores
    nvlink_gb_s: float | None  # per GPU, total; None: PCIe only

    @property
    def sm(self) -> str:
        """The compute capability as TensorRT-LLM spells it, e.g. sm90."""
        major, minor = self.compute_capability
        return f"sm{major}{minor}"

    @property
    def support(self) -> ArchSupport:
        return SUPPORT[family_of(self.compute_capability)]

    @property
    def architecture(self) -> str:
        return self.support.family

    @property
    def nvlink(self) -> bool:
        return self.nvlink_gb_s is not None

    @property
    def memory_bytes(self) -> int:
        """Device memory the driver reports, in bytes."""
        return self.memory_mib * 2**20

    def quant_algos(self, path: str) -> frozenset[str]:
        """TensorRT-LLM QuantAlgo names this GPU runs on `path` (engine or pytorch)."""
        s = self.support
        return s.engine_quant if check_path(path) == "engine" else s.pytorch_quant

    def kv_cache_algos(self, path: str) -> frozenset[str]:
        """KV cache quant algos (FP8, INT8, NVFP4) this GPU runs on `path`."""
        s = self.support
        return s.engine_kv if check_path(path) == "engine" else s.pytorch_kv

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description, for the manifest."""
        return {
            "name": self.name,
            "marketing_name": self.marketing_name,
            "architecture": self.architecture,
            "sm": self.sm,
            "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
            "memory_gb": self.memory_gb,
            "memory_mib": self.memory_mib,
            "memory_bandwidth_gb_s": self.memory_bandwidth_gb_s,
            "bf16_tflops": self.bf16_tflops,
            "fp8_tflops": self.fp8_tflops,
            "fp4_tflops": self.fp4_tflops,
            "nvlink_gb_s": self.nvlink_gb_s,
            **{f"{p}_quant_algos": sorted(self.quant_algos(p)) for p in PATHS},
            **{f"{p}_kv_cache_algos": sorted(self.kv_cache_algos(p)) for p in PATHS},
        }


PROFILES: dict[str, TargetProfile] = {
    p.name: p
    for p in (
        TargetProfile("h100-sxm", "NVIDIA H100 SXM5 80GB", (9, 0), 80, 81559, 3350,
                      989.4, 1978.9, None, 900),
        TargetProfile("h100-pcie", "NVIDIA H100 PCIe 80GB", (9, 0), 80, 81559, 2000,
                      756.5, 1513.0, None, None),
        TargetProfile("h100-nvl", "NVIDIA H100 NVL 94GB", (9, 0), 94, 95830, 3900,
                      835.5, 1670.5, None, 600),
        TargetProfile("h200", "NVIDIA H200 SXM 141GB", (9, 0), 141, 143771, 4800,
                      989.4, 1978.9, None, 900),
        TargetProfile("b200", "NVIDIA B200 180GB (HGX B200)", (10, 0), 180, 183359, 8000,
                      2250.0, 4500.0, 9000.0, 1800),
        TargetProfile("gb200", "NVIDIA GB200 186GB (Blackwell GPU of GB200 NVL72)", (10, 0),
                      186, 189471, 8000, 2500.0, 5000.0, 10000.0, 1800),
        TargetProfile("l40s", "NVIDIA L40S 48GB", (8, 9), 48, 46068, 864,
                      362.05, 733.0, None, None),
        TargetProfile("l4", "NVIDIA L4 24GB", (8, 9), 24, 23034, 300,
                      121.0, 242.5, None, None),
        TargetProfile("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation 48GB", (8, 9), 48,
                      49140, 960, 364.2, 728.5, None, None),
        TargetProfile("a100-80gb", "NVIDIA A100 80GB SXM4", (8, 0), 80, 81920, 2039,
                      312.0, None, None, 600),
        TargetProfile("a100-40gb", "NVIDIA A100 40GB SXM4", (8, 0), 40, 40960, 1555,
                      312.0, None, None, 600),
    )
}  # fmt: skip


def get_profile(name: str) -> TargetProfile:
    """The profile called `name`; UsageError listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UsageError(
            f"unknown GPU target {name!r} — known targets: {', '.join(PROFILES)}"
        ) from None


def check_path(path: str) -> str:
    if path not in PATHS:
        raise UsageError(f"unknown TensorRT-LLM path {path!r} — use engine, pytorch or both")
    return path
