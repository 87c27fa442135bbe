"""What kiln can quantise, declared once: methods, activation and KV cache modes, group sizes,
and the schemes a method, a weight width and an activation mode make together.

The recipe's schema (compiler/recipe/schema.py) takes its allowed values and per-method
defaults from here, and the recipe and `quant.schemes.check` apply the same rules
(`weight_bits_problem`, `group_size_problem`), so a spec is refused in the same words wherever it is
checked. Adding a method is one `Method` entry plus the `SchemeDef`s it produces; adding a scheme is
one `SchemeDef`. Which backend produces a scheme is declared where the backend registers itself
(quant/backends/); what TensorRT-LLM runs is the compiler's business (compiler/trtllm/targets.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLOAT_BITS = 16  # the weight width of an unquantised model


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason a spec cannot work: the recipe key, what is wrong, and what would work."""

    key: str
    problem: str
    allowed: str

    def __str__(self) -> str:
        return f"{self.key}: {self.problem} (allowed: {self.allowed})"


@dataclass(frozen=True, slots=True)
class Method:
    """A quantisation method a recipe names, and what its other keys default to."""

    name: str
    weight_bits: int = FLOAT_BITS
    group_size: int | None = None  # at the default width; other widths scale per channel
    symmetric: bool = True
    activations: str = "none"  # what `activations: default` means
    backend: str = "llmcompressor"  # the backend that produces it when the recipe names none

    def fill(
        self,
        weight_bits: int | None,
        group_size: int | None,
        symmetric: bool | None,
        activations: str,
        backend: str | None = None,
    ) -> dict[str, Any]:
        """The keys a recipe left to the method (None, or activations `default`), filled in."""
        bits = self.weight_bits if weight_bits is None else weight_bits
        default_group = self.group_size if bits == self.weight_bits else None
        return {
            "weight_bits": bits,
            "group_size": default_group if group_size is None else group_size,
            "symmetric": self.symmetric if symmetric is None else symmetric,
            "activations": self.activations if activations == "default" else activations,
            "backend": self.backend if backend is None else backend,
        }


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("none"),
        Method("fp8", 8, activations="fp8_static"),
        Method("fp8_dynamic", 8, activations="fp8_dynamic"),
        Method("awq", 4, group_size=128, symmetric=False),
        Method("gptq", 4, group_size=128),
        Method("smoothquant", 8, activations="int8_dynamic"),
        Method("nvfp4", 4, activations="nvfp4", backend="modelopt"),
    )
}

# nvfp4: FP4 per block of 16 with FP8 block scales, against a calibrated global scale.
ACTIVATIONS = ("none", "int8_dynamic", "int8_static", "fp8_dynamic", "fp8_static", "nvfp4")
# KV cache mode → TensorRT-LLM's kv_cache_quant_algo name for it.
KV_CACHE: dict[str, str | None] = {"none": None, "fp8": "FP8", "int8": "INT8"}
# Groups that kiln's quantisers and its runtime's kernels both take, largest first; None (one
# scale per output channel) is the other choice.
GROUP_SIZES = (128, 64, 32)


@dataclass(frozen=True, slots=True)
class SchemeDef:
    """A family of specs that quantise the same way (one registry entry)."""

    name: str
    methods: tuple[str, ...]
    weight_bits: int
    activations: tuple[str, ...]
    weight_type: str  # "int", "float" or "none"
    grouped: bool = False  # group_size applies (weight-only int schemes)
    asymmetric: bool = False  # zero points make sense
    calibrated: bool = True  # needs calibration data
    # TensorRT-LLM QuantAlgo per activation mode; `per_channel` is used when group_size is None.
    trtllm: tuple[tuple[str, str], ...] = ()
    trtllm_per_channel: str | None = None


SCHEMES: dict[str, SchemeDef] = {
    d.name: d
    for d in (
        SchemeDef("NO_QUANT", ("none",), FLOAT_BITS, ("none",), "none", calibrated=False,
                  trtllm=(("none", "NO_QUANT"),)),
        SchemeDef("FP8", ("fp8",), 8, ("fp8_static",), "float",
                  trtllm=(("fp8_static", "FP8"),)),
        SchemeDef("FP8_DYNAMIC", ("fp8_dynamic", "fp8"), 8, ("fp8_dynamic",), "float",
                  calibrated=False, trtllm=(("fp8_dynamic", "FP8_PER_CHANNEL_PER_TOKEN"),)),
        SchemeDef("W4A16_AWQ", ("awq",), 4, ("none",), "int", grouped=True, asymmetric=True,
                  trtllm=(("none", "W4A16_AWQ"),), trtllm_per_channel="W4A16"),
        SchemeDef("W4A8_AWQ", ("awq",), 4, ("fp8_static",), "int", grouped=True,
                  trtllm=(("fp8_static", "W4A8_AWQ"),)),
        SchemeDef("W4A16_GPTQ", ("gptq",), 4, ("none",), "int", grouped=True, asymmetric=True,
                  trtllm=(("none", "W4A16_GPTQ"),), trtllm_per_channel="W4A16"),
        SchemeDef("W8A16", ("gptq",), 8, ("none",), "int", grouped=True, asymmetric=True,
                  trtllm=(("none", "W8A16_GPTQ"),), trtllm_per_channel="W8A16"),
        SchemeDef("W8A8_SQ", ("smoothquant",), 8, ("int8_dynamic", "int8_static"), "int",
                  trtllm=(("int8_dynamic", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"),
                          ("int8_static", "W8A8_SQ_PER_CHANNEL"))),
        SchemeDef("NVFP4", ("nvfp4",), 4, ("nvfp4",), "float", trtllm=(("nvfp4", "NVFP4"),)),
    )
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ExpertLimit:
    """Schemes a backend produces for dense linears but not for a mixture of experts' experts
    (one registry entry): the recipe key to change, why, and what works instead."""

    backend: str
    schemes: tuple[str, ...]
    key: str
    why: str
    instead: str
    asymmetric_only: bool = False  # only with zero points (symmetric: false)


# Each found by compiling tiny Mixtral and Qwen3-MoE checkpoints: llm-compressor quantises and
# saves the experts, then transformers 5 cannot load them back (every later stage would fail
# after calibrating).
MOE_EXPERT_LIMITS = (
    ExpertLimit(
        "llmcompressor", ("W8A8_SQ",), "quantization.method",
        "transformers 5 cannot load llm-compressor's int8 experts back (it fuses each expert's "
        "int8 gate and up weights into one gate_up_proj and finds none)",
        "method fp8 or fp8_dynamic (FP8), gptq (W4A16, or weight_bits: 8 for W8A16) or awq "
        "with symmetric: true; or smoothquant with activations: int8_static and backend: "
        "modelopt (calibration.moe_experts: warn)",
    ),
    ExpertLimit(
        "llmcompressor", ("W4A16_AWQ", "W4A16_GPTQ", "W8A16"), "quantization.symmetric",
        "transformers 5 cannot load llm-compressor's experts with zero points back (its "
        "DecompressExperts finds no zero points: 'Asymmetric quant requires zero-point values')",
        "symmetric: true (no zero points), or method fp8 or fp8_dynamic",
        asymmetric_only=True,
    ),
)  # fmt: skip

# The widths a recipe can ask for: every quantised width some scheme produces.
WEIGHT_BITS = tuple(sorted({d.weight_bits for d in SCHEMES.values()} - {FLOAT_BITS}))


def weight_widths(method: str) -> tuple[int, ...]:
    """The weight widths `method` produces, from the schemes it makes."""
    return tuple(sorted({d.weight_bits for d in SCHEMES.values() if method in d.methods}))


def weight_bits_problem(method: str, weight_bits: int) -> Problem | None:
    """The weight-bits rule: a method quantises weights only to the widths of its schemes."""
    widths = weight_widths(method)
    if weight_bits in widths:
        return None
    return Problem(
        "quantization.weight_bits",
        f"{method} does not quantise weights to {weight_bits} bits",
        " or ".join(map(str, widths)),
    )


def group_size_problem(group_size: int | None) -> Problem | None:
    """The group-size rule: one of GROUP_SIZES, or None for one scale per output channel."""
    if group_size is None or group_size in GROUP_SIZES:
        return None
    return Problem(
        "quantization.group_size",
        f"group size {group_size} is not one that kiln's quantisers and runtime take",
        ", ".join(map(str, GROUP_SIZES)) + " or null (per channel)",
    )
