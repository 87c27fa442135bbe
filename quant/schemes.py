"""The checks that a spec can work before anything loads, and the scheme it resolves to.

A `QuantSpec` (method, bits, activations, KV cache, backend) resolves to one canonical
`Scheme`, named like TensorRT-LLM's `QuantAlgo` where it has one (FP8, W4A16_AWQ, ...).
The methods, modes and schemes, and the rules they share with the recipe, are declared in
quant/registry.py; which backend can produce a scheme, where the backend registers itself
(quant/backends/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.quant.backends import BACKENDS
from kiln.quant.registry import (
    ACTIVATIONS,
    GROUP_SIZES,
    KV_CACHE,
    METHODS,
    MOE_EXPERT_LIMITS,
    SCHEMES,
    Problem,
    SchemeDef,
    group_size_problem,
    weight_bits_problem,
)
from kiln.quant.selection import quantised_linears
from kiln.quant.spec import QuantSpec, Scheme
from kiln.runtime.base.errors import PreflightError

if TYPE_CHECKING:
    from kiln.runtime.formats.model_info import ModelInfo


def _spec_problems(spec: QuantSpec) -> tuple[SchemeDef | None, list[Problem]]:
    """Match a spec against SCHEMES; the problems say why nothing (or something) does not fit."""
    if spec.method not in METHODS:
        return None, [
            Problem("quantization.method", f"unknown method {spec.method!r}", ", ".join(METHODS))
        ]
    problems: list[Problem] = []

    def add(key: str, problem: str, allowed: str) -> None:
        problems.append(Problem(f"quantization.{key}", problem, allowed))

    if spec.kv_cache not in KV_CACHE:
        add("kv_cache", f"unknown KV cache mode {spec.kv_cache!r}", ", ".join(KV_CACHE))
    if spec.activations not in ACTIVATIONS:
        add("activations", f"unknown activation mode {spec.activations!r}", ", ".join(ACTIVATIONS))
        return None, problems
    bits_problem = weight_bits_problem(spec.method, spec.weight_bits)
    if bits_problem is not None:
        return None, [*problems, bits_problem]
    candidates = [
        d
        for d in SCHEMES.values()
        if spec.method in d.methods and d.weight_bits == spec.weight_bits
    ]
    match = next((d for d in candidates if spec.activations in d.activations), None)
    if match is None:
        acts = [a for d in candidates for a in d.activations]
        add(
            "activations",
            f"method {spec.method} with {spec.weight_bits}-bit weights cannot "
            f"use activations {spec.activations}",
            ", ".join(acts),
        )
        return None, problems
    if spec.group_size is not None and not match.grouped:
        add(
            "group_size",
            f"{match.name} scales per output channel; group_size applies to awq and gptq only",
            "null",
        )
    group_problem = group_size_problem(spec.group_size)
    if match.grouped and group_problem is not None:
        problems.append(group_problem)
    if not spec.symmetric and not match.asymmetric:
        add("symmetric", f"{match.name} is symmetric only (no zero points)", "true")
    if match.name == "NO_QUANT" and spec.kv_cache != "none":
        add(
            "kv_cache",
            "method none copies the float model unchanged; a quantised KV "
            "cache needs a quantisation method",
            "none",
        )
    return match, problems


def _backend_problems(spec: QuantSpec, scheme: SchemeDef) -> list[Problem]:
    backend = BACKENDS.get(spec.backend)
    if backend is None:
        return [
            Problem(
                "quantization.backend", f"unknown backend {spec.backend!r}", ", ".join(BACKENDS)
            )
        ]
    others = [b.name for b in BACKENDS.values() if b is not backend and scheme.name in b.schemes]
    alternative = f"; {' or '.join(others)} can do {scheme.name}" if others else ""
    problems: list[Problem] = []

    def add(key: str, problem: str, allowed: str) -> None:
        problems.append(Problem(f"quantization.{key}", problem, allowed))

    if scheme.name not in backend.schemes:
        add(
            "backend",
            f"{backend.name} cannot produce {scheme.name}{alternative}",
            f"{backend.name} does {', '.join(sorted(backend.schemes))}",
        )
        return problems
    if spec.activations not in backend.activations:
        add(
            "activations",
            f"{backend.name} cannot calibrate activations {spec.activations}",
            ", ".join(a for a in scheme.activations if a in backend.activations),
        )
    if spec.kv_cache not in backend.kv_cache:
        add(
            "kv_cache",
            f"{backend.name} cannot quantise the KV cache to {spec.kv_cache}",
            ", ".join(sorted(backend.kv_cache)),
        )
    if not spec.symmetric and scheme.asymmetric and scheme.name not in backend.asymmetric:
        add("symmetric", f"{backend.name} does {scheme.name} symmetric only", "true")
    if scheme.grouped and spec.group_size is None and scheme.name not in backend.per_channel:
        add(
            "group_size",
            f"{backend.name} does {scheme.name} with groups (blocks) only",
            ", ".join(map(str, GROUP_SIZES)),
        )
    return problems


def _group_problems(spec: QuantSpec, info: ModelInfo) -> list[Problem]:
    group = spec.group_size
    if group is None:
        return []
    dims = {shape[1] for shape in quantised_linears(info, spec.ignore).values()}
    bad = sorted(d for d in dims if d % group)
    if not bad:
        return []
    works = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
    fix = f"use {' or '.join(map(str, works))}" if works else "use group_size: null (per channel)"
    problem = f"{', '.join(map(str, bad))} is not divisible by {group} — {fix}"
    owners = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, s in quantised_linears(info, spec.ignore).items()
            if s[1] in bad
        }
    )
    return [
        Problem(
            "quantization.group_size",
            f"{problem} (in_features of {', '.join(owners)})",
            ", ".join(map(str, works)) or "null",
        )
    ]


def _expert_problems(spec: QuantSpec, scheme: SchemeDef, info: ModelInfo) -> list[Problem]:
    """The backend's MOE_EXPERT_LIMITS entry for this scheme, where it would quantise experts."""
    found = [
        e
        for e in MOE_EXPERT_LIMITS
        if e.backend == spec.backend and scheme.name in e.schemes
        and not (e.asymmetric_only and spec.symmetric)
    ]  # fmt: skip
    if not found or info.moe is None:
        return []
    limit = found[0]
    if not any(".experts." in name for name in quantised_linears(info, spec.ignore)):
        return []
    zero_points = " with zero points" if limit.asymmetric_only else ""
    return [
        Problem(
            limit.key,
            f"{scheme.name}{zero_points} from {spec.backend} on {info.architecture}'s experts: "
            f"{limit.why}, so every stage after calibration would fail",
            limit.instead,
        )
    ]


def check(spec: QuantSpec, info: ModelInfo | None = None) -> list[Problem]:
    """Everything wrong with a spec, without loading weights; empty when it can work.

    With `info`, also checks that the group size divides the in_features of every
    quantised linear (those not matched by `ignore`), and that the backend can quantise a
    mixture of experts' experts with this scheme (MOE_EXPERT_LIMITS).
    """
    match, problems = _spec_problems(spec)
    if match is None:
        return problems
    problems += _backend_problems(spec, match)
    if info is not None and match.grouped:
        problems += _group_problems(spec, info)
    if info is not None:
        problems += _expert_problems(spec, match, info)
    return problems


def resolve(spec: QuantSpec) -> Scheme:
    """The canonical scheme for a spec; raises PreflightError listing what is wrong."""
    match, problems = _spec_problems(spec)
    if match is None or problems:
        raise PreflightError(
            "quantization spec cannot work:\n" + "\n".join(f"  {p}" for p in problems)
        )
    algo = dict(match.trtllm)[spec.activations]
    if match.grouped and spec.group_size is None and match.trtllm_per_channel:
        algo = match.trtllm_per_channel
    return Scheme(
        name=match.name,
        method=spec.method,
        weight_bits=spec.weight_bits,
        weight_type=match.weight_type,
        group_size=spec.group_size if match.grouped else None,
        symmetric=spec.symmetric,
        activations=spec.activations,
        kv_cache=spec.kv_cache,
        needs_calibration=match.calibrated or spec.kv_cache != "none",
        trtllm_quant_algo=algo,
        trtllm_kv_cache_quant_algo=KV_CACHE[spec.kv_cache],
        spec=spec,
    )


# The scheme of a model kept in float (method none), for what has no quantisation of its own.
FLOAT_SCHEME = resolve(QuantSpec())
