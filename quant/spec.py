"""Plain typed descriptions of what to quantise and with what data.

The recipe (compiler/recipe/schema.py) validates user input once, at the edge, and hands these
frozen dataclasses to the quantisation code; nothing below the edge re-validates YAML.
The values a field may take are declared in quant/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A checkpoint is calibrated, and its report run, in its own float dtype: an 8B bf16 model
# needs 16 GB, not 32, and computes as it is deployed.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def calibration_dtype(checkpoint_dtype: str) -> str:
    """The torch dtype name a checkpoint is computed in (float32 if unknown)."""
    name = checkpoint_dtype.removeprefix("torch.")
    return name if name in DTYPE_BYTES else "float32"


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """The recipe's `quantization` section after validation and defaulting."""

    method: str = "none"
    weight_bits: int = 16  # 16 means "not quantised" (method none)
    group_size: int | None = None  # None: one scale per output channel
    symmetric: bool = True
    activations: str = "none"
    kv_cache: str = "none"
    ignore: tuple[str, ...] = ("lm_head",)
    backend: str = "llmcompressor"
    smoothing_strength: float = 0.8  # SmoothQuant migration strength alpha
    dampening_frac: float = 0.01  # GPTQ Hessian dampening


@dataclass(frozen=True, slots=True)
class CalibrationSpec:
    """The recipe's `calibration` section: where text comes from and how much of it."""

    dataset: str = (
        "builtin:shakespeare"  # builtin:NAME | path.txt | path.jsonl | traffic:path.jsonl
    )
    num_samples: int = 64
    max_seq_len: int = 256
    seed: int = 0
    text_field: str = "text"  # for plain jsonl datasets
    moe_experts: str = "all"  # all | warn | fail (quant/moe_routing.py)
    moe_min_tokens: int = 16
    base_dir: str = "."  # relative dataset paths resolve against the recipe's directory
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scheme:
    """A resolved scheme: everything a backend, the exporter and the manifest need to know."""

    name: str
    method: str
    weight_bits: int
    weight_type: str
    group_size: int | None
    symmetric: bool
    activations: str
    kv_cache: str
    needs_calibration: bool
    trtllm_quant_algo: str
    trtllm_kv_cache_quant_algo: str | None
    spec: QuantSpec  # what it was resolved from: the backend, ignore list and its settings

    @property
    def label(self) -> str:
        """Name plus KV cache mode, e.g. `FP8+KV_FP8`."""
        return self.name if self.kv_cache == "none" else f"{self.name}+KV_{self.kv_cache.upper()}"
