"""The candidates `kiln search` tries: each uniform scheme the targets run, with and without
an FP8 KV cache, and mixed precision built from measured per-layer sensitivity (the k most
sensitive linear groups kept in float, the rest in the scheme). Every candidate is a normal
recipe: the searched recipe with its `quantization:` section replaced, written out and
compiled like any other. Which schemes a target runs is the support matrix's answer
(compiler/trtllm/rules/support.py `check_target`).

Mixed precision keeps whole groups float where TensorRT-LLM fuses linears into one GEMM
(q, k and v; Phi-3's qkv_proj and gate_up_proj; a layer's experts are one MoE module) or
a group-wise kernel ties them: a group is what can be excluded on its own. No library builds
these from kiln's report, so this module is ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.compiler.recipe.schema import QuantizationSection, section_spec
from kiln.compiler.trtllm.rules.support import check_target
from kiln.quant.schemes import check, resolve
from kiln.quant.spec import Scheme
from kiln.runtime.formats.model_info import ModelInfo

# The uniform schemes by the names `--schemes` takes → their recipe's quantization section.
SCHEMES: dict[str, dict[str, Any]] = {
    "fp8": {"method": "fp8"},
    "fp8_dynamic": {"method": "fp8_dynamic"},
    "w8a8": {"method": "smoothquant"},
    "w8a16": {"method": "gptq", "weight_bits": 8},
    "w4a16": {"method": "gptq"},
    "w4a16_awq": {"method": "awq"},
    # W4A8_AWQ stores no zero points, so the recipe must say symmetric (quant/schemes.py).
    "w4a8": {
        "method": "awq",
        "activations": "fp8_static",
        "backend": "modelopt",
        "symmetric": True,
    },
    "nvfp4": {"method": "nvfp4"},
}
KV_VARIANTS = ("none", "fp8")


@dataclass
class Candidate:
    """One recipe variant: its id, quantization section and how it was built."""

    id: str
    scheme_name: str  # a SCHEMES key
    quantization: dict[str, Any]  # the recipe's whole quantization section
    kind: str = "uniform"  # uniform | mixed
    kept_float: list[str] = field(default_factory=list)  # mixed: the groups kept float
    parent: str | None = None  # mixed: the uniform candidate its sensitivity came from
    targets: list[str] = field(default_factory=list)  # the searched targets that run it

    @property
    def scheme(self) -> Scheme:
        return resolve(section_spec(QuantizationSection(**self.quantization)))


def quantization_section(
    name: str, kv_cache: str, ignore: list[str], info: ModelInfo | None = None
) -> dict[str, Any]:
    """The complete quantization section of scheme `name` (every key written, so nothing of
    the searched recipe's own section carries over through `extends:`); a group-wise scheme
    takes the largest of its group size, 64 and 32 that divides the model's linears."""
    section = QuantizationSection(**SCHEMES[name], kv_cache=kv_cache, ignore=ignore)
    grouped = section_spec(section)
    if info is not None and grouped.group_size is not None:
        for group in dict.fromkeys((grouped.group_size, 64, 32)):
            trial = QuantizationSection(
                **{**SCHEMES[name], "group_size": group}, kv_cache=kv_cache, ignore=ignore
            )
            if not check(section_spec(trial), info):
                section = trial
                break
    return section.model_dump(mode="json")


def unknown_schemes(names: list[str]) -> list[str]:
    return [n for n in names if n not in SCHEMES]


def uniform_candidates(
    names: list[str],
    kv_variants: list[str],
    targets: list[str],
    path: str,
    ignore: list[str],
    info: ModelInfo | None = None,
) -> tuple[list[Candidate], dict[str, str]]:
    """Each scheme × KV variant kiln accepts and some target runs on `path` (with the
    targets that run it), and why the others were left out (candidate id → reason)."""
    out, skipped = [], {}
    for name in dict.fromkeys(names):
        for kv in dict.fromkeys(kv_variants):
            cid = name if kv == "none" else f"{name}-kv{kv}"
            section = quantization_section(name, kv, ignore, info)
            refused = check(section_spec(QuantizationSection(**section)), info)
            if refused:
                skipped[cid] = f"kiln refuses it ({refused[0]})"
                continue
            cand = Candidate(cid, name, section)
            problems = {t: check_target(cand.scheme, t, path) for t in targets}
            cand.targets = [t for t, p in problems.items() if not p]
            if cand.targets:
                out.append(cand)
            else:
                first = next(p for ps in problems.values() for p in ps)
                skipped[cid] = f"runs on none of the targets ({first.problem})"
    return out, skipped


def linear_groups(info: ModelInfo) -> list[list[str]]:
    """The linears (HF module names) kept float together, layer by layer: attention's
    q/k/v (or Phi-3's qkv_proj), o_proj, the MLP's gate and up (gate_up_proj), down_proj; a
    sparse layer's experts and router as one."""
    groups = []
    for layer in range(info.num_layers):
        prefix = f"model.layers.{layer}."
        names = list(info.layer_linears(layer))
        qkv = [n for n in names if n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj")]
        gate_up = [n for n in names if n in ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj")]
        sparse = [n for n in names if ".experts." in n]
        moe = info.moe
        if sparse and moe is not None:
            sparse.append(f"{moe.block}.{moe.router}")
        rest = [n for n in names if n not in qkv + gate_up + sparse]
        for group in (
            qkv,
            *([n] for n in rest if n.startswith("self_attn")),
            gate_up,
            *([n] for n in rest if not n.startswith("self_attn")),
            sparse,
        ):
            if group:
                groups.append([prefix + n for n in group])
    return groups


def sensitivities(report: dict[str, Any], info: ModelInfo) -> list[tuple[float, list[str]]]:
    """Each linear group with its measured sensitivity — the largest relative weight error
    (rel_mse) the quantisation report gives its members — most sensitive first. Groups the
    report does not measure (fused experts) count as 0."""
    errors = {row["name"]: float(row["rel_mse"]) for row in report.get("layers", [])}
    scored = [
        (max((errors.get(n, 0.0) for n in group), default=0.0), group)
        for group in linear_groups(info)
    ]
    return sorted(scored, key=lambda s: -s[0])


def mixed_candidate(parent: Candidate, ranked: list[tuple[float, list[str]]], k: int) -> Candidate:
    """`parent`'s scheme with the `k` most sensitive groups of `ranked` kept float."""
    kept = [name for _, group in ranked[:k] for name in group]
    section = dict(parent.quantization)
    section["ignore"] = list(dict.fromkeys([*section.get("ignore", []), *kept]))
    return Candidate(
        f"{parent.id}-keep{k}",
        parent.scheme_name,
        section,
        kind="mixed",
        kept_float=kept,
        parent=parent.id,
        targets=list(parent.targets),
    )
