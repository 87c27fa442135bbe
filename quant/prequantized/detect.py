"""What a published pre-quantised checkpoint holds (AutoAWQ, AutoGPTQ, GPTQModel), read from
its config alone: its method, bits, group size, zero points and packing, whether kiln can
convert it exactly (convert.py), and whether a recipe asks for something else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.quant.registry import Problem
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import SourceError
from kiln.runtime.base.files import read_text

SIDECAR_CONFIGS = ("quantize_config.json", "quant_config.json")  # AutoGPTQ, early AutoAWQ


SUPPORTED = "AutoAWQ GEMM (4-bit) and AutoGPTQ / GPTQModel gptq or gptq_v2 (4- or 8-bit)"


@dataclass(frozen=True, slots=True)
class PreQuantized:
    """What a checkpoint's `quantization_config` says about its already-quantised weights."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int | None  # None: one scale per output channel (the libraries' -1)
    symmetric: bool
    format: str  # "gemm" (AWQ) | "gptq" (v1, zero − 1 stored) | "gptq_v2"
    producer: str  # "autoawq", "autogptq", "gptqmodel"
    desc_act: bool = False  # GPTQ act-order (only with static groups: trivial g_idx)
    lm_head: bool = False  # GPTQModel can quantise the LM head
    not_converted: tuple[str, ...] = ()  # AWQ modules_to_not_convert

    @property
    def scheme(self) -> str:
        """The canonical scheme name (quant.schemes.SCHEMES) of the imported weights."""
        if self.bits == 8:
            return "W8A16"
        return "W4A16_AWQ" if self.method == "awq" else "W4A16_GPTQ"

    def to_spec(self) -> QuantSpec:
        """The quantization spec this checkpoint embodies (weights only, no KV quantisation)."""
        ignore = () if self.lm_head else ("lm_head",)
        return QuantSpec(
            method=self.method,
            weight_bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            ignore=ignore + self.not_converted,
        )


def _refuse(key: str, value: Any, why: str) -> SourceError:
    return SourceError(
        f"config.json quantization_config.{key}={value!r}: {why}; kiln imports {SUPPORTED} "
        "checkpoints — use one of those or the float checkpoint it was made from"
    )


def _group(value: Any) -> int | None:
    group = int(value) if isinstance(value, (int, str)) and str(value).lstrip("-").isdigit() else 0
    if group == -1:
        return None
    if group <= 0:
        raise _refuse("group_size", value, "not a positive group size or -1")
    return group


def _detect_awq(qc: dict[str, Any]) -> PreQuantized:
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version != "gemm":
        raise _refuse("version", version, f"the AWQ {version} packing is not imported")
    if str(qc.get("backend", "autoawq")).lower() == "llm-awq":
        raise _refuse("backend", "llm-awq", "llm-awq packs int16 GEMV words, not AutoAWQ GEMM")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise _refuse("bits", bits, "AutoAWQ GEMM stores 4-bit codes only")
    if not qc.get("zero_point", True):
        raise _refuse("zero_point", False, "AutoAWQ GEMM packs zero points; this one has none")
    group = _group(qc.get("group_size", qc.get("q_group_size", 128)))
    producer = "gptqmodel" if "quantizer" in (qc.get("meta") or {}) else "autoawq"
    skipped = tuple(qc.get("modules_to_not_convert") or ())
    return PreQuantized("awq", 4, group, False, "gemm", producer, not_converted=skipped)


def _detect_gptq(qc: dict[str, Any]) -> PreQuantized:
    # GPTQModel writes `format` and its older alias `checkpoint_format`; AutoGPTQ writes neither
    # (or checkpoint_format), and a missing one means v1, as GPTQModel's loader assumes.
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, f"the {fmt} packing is not imported")
    if str(qc.get("pack_dtype", "int32")) != "int32":
        raise _refuse("pack_dtype", qc["pack_dtype"], "only int32 words are imported")
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise _refuse("bits", bits, "compressed-tensors and TensorRT-LLM take 4- or 8-bit codes")
    meta = qc.get("meta") or {}
    desc_act = bool(qc.get("desc_act", False))
    static_groups = bool(qc.get("static_groups", meta.get("static_groups", False)))
    if desc_act and not static_groups:
        why = "act-order without static_groups permutes groups by g_idx, which compressed-tensors"
        raise _refuse("desc_act", True, why + " 0.19 and TensorRT-LLM cannot hold")
    dynamic = qc.get("dynamic") or {}
    overrides = [k for k in dynamic if not str(k).startswith("-:")]
    if overrides:
        raise _refuse("dynamic", overrides, "per-module bits or group sizes are not imported")
    quantizers = meta.get("quantizer") or []
    quantizers = [quantizers] if isinstance(quantizers, str) else quantizers
    producer = "gptqmodel" if any("gptqmodel" in str(q) for q in quantizers) else "autogptq"
    group, symmetric = _group(qc.get("group_size", 128)), bool(qc.get("sym", True))
    lm_head = bool(qc.get("lm_head", False))
    return PreQuantized("gptq", bits, group, symmetric, fmt, producer, desc_act, lm_head)


def detect(config: dict[str, Any]) -> PreQuantized | None:
    """The AWQ/GPTQ checkpoint described by a config.json dict; None if it is not one.

    Raises SourceError for an AWQ or GPTQ variant that cannot be imported exactly (GEMV,
    Marlin, desc_act with a g_idx permutation, 2/3-bit, ...). Other quantisation methods
    (compressed-tensors, fp8, bitsandbytes, ...) give None: they are not imports.
    """
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or not qc:
        return None
    method = str(qc.get("quant_method") or qc.get("method") or "").lower()
    packing = str(qc.get("checkpoint_format") or qc.get("format") or "").lower()
    if method == "gptq" and packing in ("gemm", "gemv", "gemv_fast"):
        method = "awq"  # GPTQModel's RTN export labels AWQ packings gptq; its loader does this
    if method == "awq":
        return _detect_awq(qc)
    if method == "gptq":
        return _detect_gptq(qc)
    return None


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object; SourceError naming it otherwise."""
    try:
        data = json.loads(read_text(path, SourceError))
    except json.JSONDecodeError as exc:
        raise SourceError(f"{path}: not valid JSON ({exc}); restore the model's own file") from None
    if not isinstance(data, dict):
        raise SourceError(
            f"{path}: holds {json.dumps(data)[:40]}, not a JSON object of settings; restore "
            "the model's own file"
        )
    return data


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json, with `quantization_config` taken from quantize_config.json or
    quant_config.json when config.json has none (AutoGPTQ and early AutoAWQ wrote only those)."""
    config = _json_object(Path(model_dir) / "config.json")
    if config.get("quantization_config"):
        return config
    for name in SIDECAR_CONFIGS:
        path = Path(model_dir) / name
        if path.is_file():
            sidecar = _json_object(path)
            if name == "quant_config.json" and "quant_method" not in sidecar:
                sidecar = {"quant_method": "awq", **sidecar}  # AutoAWQ's own file
            elif "quant_method" not in sidecar:
                sidecar = {"quant_method": "gptq", **sidecar}
            return {**config, "quantization_config": sidecar}
    return config


def check_recipe(spec: QuantSpec, pre: PreQuantized) -> list[Problem]:
    """Where a recipe's quantization section disagrees with a pre-quantised source.

    An import is not re-quantised, so the section must be omitted (method none, the recipe
    default) or describe the checkpoint: same method, bits, group size and symmetry, weights
    only, no KV cache quantisation. `ignore` is compared only when the recipe sets it.
    """
    if spec.method == "none":
        return []
    want = pre.to_spec()
    what = f"the source is a {pre.bits}-bit {pre.method.upper()} checkpoint ({pre.producer})"
    fix = "or omit the quantization section"
    problems: list[Problem] = []

    def differs(key: str, got: Any, expected: Any, shown: str) -> None:
        if got != expected:
            problem = f"{got!r} does not match: {what}, imported without re-quantising"
            problems.append(Problem(f"quantization.{key}", problem, f"{shown} {fix}"))

    differs("method", spec.method, want.method, want.method)
    differs("weight_bits", spec.weight_bits, want.weight_bits, str(want.weight_bits))
    differs("group_size", spec.group_size, want.group_size, str(want.group_size or "null"))
    differs("symmetric", spec.symmetric, want.symmetric, str(want.symmetric).lower())
    differs("activations", spec.activations, "none", "none (weights only)")
    differs("kv_cache", spec.kv_cache, "none", "none (an import has no calibration)")
    if spec.ignore != QuantSpec().ignore and set(spec.ignore) != set(want.ignore):
        differs("ignore", list(spec.ignore), list(want.ignore), str(list(want.ignore)))
    return problems
