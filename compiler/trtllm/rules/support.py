"""Does a scheme run on a GPU target? The support matrix (targets.py) applied to a resolved
scheme, per TensorRT-LLM path, with the reason in the field's words and what would work
instead; plus whether what kiln writes for the scheme loads on that path (its 1.2
checkpoint export, the PyTorch backend's checkpoint formats, or kiln's exact conversion).
"""

from __future__ import annotations

from kiln.compiler.trtllm.rules.checkpoint import CHECKPOINT_ALGO, NOT_EXPORTED
from kiln.compiler.trtllm.rules.engine import engine_problem
from kiln.compiler.trtllm.rules.exclusions import group_problem, group_sizes
from kiln.compiler.trtllm.rules.other_servers import serves_elsewhere
from kiln.compiler.trtllm.rules.pytorch import (
    CONVERTS,
    conversion_problem,
    family_problem,
    pytorch_problem,
)
from kiln.compiler.trtllm.targets import (
    PATH_LABELS,
    PATHS,
    PROFILES,
    SMOOTHQUANT,
    WEIGHT_ONLY,
    TargetProfile,
    check_path,
)
from kiln.quant.backends import BACKENDS
from kiln.quant.registry import Problem
from kiln.quant.spec import Scheme
from kiln.runtime.formats.model_info import ModelInfo


def path_problems(info: ModelInfo, scheme: Scheme) -> dict[str, Problem | None]:
    """Per TensorRT-LLM path, why kiln cannot deploy this model family there with `scheme`
    (None where it can): the engine path's checkpoint export, the PyTorch backend's model
    classes and what their loaders read (pytorch.family_problem)."""
    algo, kv_algo = scheme.trtllm_quant_algo, scheme.trtllm_kv_cache_quant_algo
    engine = engine_problem(info, CHECKPOINT_ALGO.get(algo, algo), kv_algo)
    why = family_problem(info, CONVERTS.get(algo, algo), kv_algo)
    elsewhere = serves_elsewhere(info, algo)
    pytorch = None if why is None else Problem(
        "targets", f"TensorRT-LLM's PyTorch backend: {why}",
        elsewhere if engine is not None else f"deploy.trtllm_path: engine, or {elsewhere}",
    )  # fmt: skip
    if engine is not None and pytorch is not None:  # neither path: say so, not "pytorch"
        engine = Problem(engine.key, engine.problem, elsewhere)
    return {"engine": engine, "pytorch": pytorch}


FP8_ALGOS = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "W4A8_AWQ"})


FP4_ALGOS = frozenset({"NVFP4", "W4A8_NVFP4_FP8", "W4A8_MXFP4_FP8", "W4A16_MXFP4"})


INT4_ALGOS = frozenset({"W4A16", "W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ"})


# Each QuantAlgo kiln can produce: (short name, how a recipe asks for it).
RECIPE_FOR = {
    "FP8": ("FP8", "method: fp8"),
    "FP8_PER_CHANNEL_PER_TOKEN": ("FP8 rowwise", "method: fp8_dynamic"),
    "W4A16_AWQ": ("W4A16 AWQ", "method: awq"),
    "W4A16_GPTQ": ("W4A16 GPTQ", "method: gptq"),
    "W8A16": ("W8A16", "method: gptq, weight_bits: 8"),
    "W4A8_AWQ": ("W4A8 AWQ", "method: awq, activations: fp8_static, backend: modelopt"),
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": ("W8A8 SmoothQuant", "method: smoothquant"),
    "NVFP4": ("NVFP4", "method: nvfp4, backend: modelopt"),
}


def describe(algo: str) -> str:
    """`algo` with the recipe that produces it, e.g. `W8A16 (method: gptq, weight_bits: 8)`."""
    name, recipe = RECIPE_FOR.get(algo, (algo, ""))
    return f"{name} ({recipe})" if recipe else name


def _why_not(algo: str, target: TargetProfile, path: str) -> str:
    """The reason `algo` does not run on `target` on `path`, in the field's words."""
    gpu = f"{target.name} ({target.architecture}, {target.sm})"
    blackwell = target.compute_capability[0] >= 10
    if algo in FP4_ALGOS and not blackwell:
        return f"{gpu} has no FP4 tensor cores; NVFP4 needs Blackwell (sm100/sm120)"
    if algo in FP8_ALGOS and target.compute_capability < (8, 9):
        return f"{gpu} has no FP8 tensor cores"
    if algo in SMOOTHQUANT and path == "pytorch":
        return "TensorRT-LLM runs INT8 SmoothQuant only in TensorRT engines (1.2.x)"
    if algo in INT4_ALGOS | WEIGHT_ONLY and blackwell and path == "pytorch":
        return f"TensorRT-LLM's PyTorch backend has no INT4/INT8 weight-only kernels for {gpu}"
    if algo == "FP8_PER_CHANNEL_PER_TOKEN" and blackwell:
        return f"TensorRT-LLM has no FP8 rowwise (per-channel × per-token) GEMMs for {gpu}"
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return "TensorRT-LLM's PyTorch backend runs FP8 rowwise on Hopper only"
    return f"TensorRT-LLM does not list {algo} for {gpu}"


def _alternatives(target: TargetProfile, path: str, algo: str) -> str:
    """What would work instead: algos this GPU runs on `path`, then a GPU that runs `algo`."""
    runs = [describe(a) for a in RECIPE_FOR if a in target.quant_algos(path)]
    if "FP8" in target.kv_cache_algos(path):
        runs.append("an FP8 KV cache alone (kv_cache: fp8)")
    other = next((p.name for p in PROFILES.values() if algo in p.quant_algos(path)), None)
    text = "use " + ", ".join(runs) if runs else "keep method none"
    return f"{text}; or target {other}" if other else text


def check_algos(
    algo: str, kv_algo: str | None, target: TargetProfile, path: str = "both"
) -> list[Problem]:
    """Problems running TensorRT-LLM `algo` (+ `kv_algo`) on `target` on `path`.

    `path` is engine, pytorch, or both (the artifact must work on both).
    """
    paths = PATHS if path == "both" else (check_path(path),)
    problems: list[Problem] = []
    bad = [p for p in paths if algo not in target.quant_algos(p)]
    if bad:
        where = " or ".join(PATH_LABELS[p] for p in bad)
        spared = [p for p in PATHS if p not in bad and algo in target.quant_algos(p)]
        note = f"; the {spared[0]} path runs it" if spared else ""
        problems.append(
            Problem(
                "quantization.method",
                f"{algo} does not run on {target.name} on the {where}: "
                f"{_why_not(algo, target, bad[0])}{note}",
                _alternatives(target, bad[0], algo),
            )
        )
    if kv_algo is not None:
        for p in paths:
            if kv_algo not in target.kv_cache_algos(p):
                kinds = " or ".join(sorted(target.kv_cache_algos(p)))
                problems.append(
                    Problem(
                        "quantization.kv_cache",
                        f"{kv_algo} KV cache does not run on {target.name} on the "
                        f"{PATH_LABELS[p]}, whose KV cache takes {kinds}",
                        ", ".join(k.lower() for k in sorted(target.kv_cache_algos(p))) + " or none",
                    )
                )
    return problems


def _unloadable(scheme: Scheme, path: str) -> str | None:
    """Why what kiln writes for `scheme` cannot be loaded on `path` (None: it can), judged
    from the recipe alone: the engine path needs kiln's checkpoint export of the scheme, the
    PyTorch path a checkpoint format its loader reads (pytorch.pytorch_problem), or
    an exact ModelOpt HF conversion of it (modelopt_hf.conversion_problem)."""
    algo, spec = scheme.trtllm_quant_algo, scheme.spec
    if path == "engine":
        if algo in NOT_EXPORTED:
            return f"{algo} has no TensorRT-LLM checkpoint export: {NOT_EXPORTED[algo]}"
        return None if algo in CHECKPOINT_ALGO else f"{algo} has no TensorRT-LLM checkpoint export"
    backend = BACKENDS.get(spec.backend)
    fmt = "float" if algo == "NO_QUANT" else backend.format if backend else None
    why = None if fmt is None else pytorch_problem(fmt, algo)
    if why is None or fmt != "compressed-tensors":
        return why
    converts = conversion_problem(
        algo, scheme.trtllm_kv_cache_quant_algo, symmetric=spec.symmetric,
        group_size=spec.group_size,
    )  # fmt: skip
    return None if converts is None else f"{why}; nor does kiln convert it exactly: {converts}"


def check_target(scheme: Scheme, target_name: str, path: str = "both") -> list[Problem]:
    """Everything that stops `scheme` running on GPU `target_name`; empty when it can.

    `path`: engine (TensorRT-LLM 1.2.x engines), pytorch (trtllm-serve) or both.
    """
    if path != "both":
        check_path(path)
    if target_name not in PROFILES:
        return [Problem("targets", f"unknown GPU target {target_name!r}", ", ".join(PROFILES))]
    algo, kv_algo = scheme.trtllm_quant_algo, scheme.trtllm_kv_cache_quant_algo
    problems = check_algos(algo, kv_algo, PROFILES[target_name], path)
    paths = PATHS if path == "both" else (path,)
    blocked = {p: why for p in paths if (why := _unloadable(scheme, p)) is not None}
    if not problems and len(blocked) == len(paths):
        where = "; ".join(f"{PATH_LABELS[p]}: {why}" for p, why in blocked.items())
        problems.append(Problem("deploy.trtllm_path", f"{target_name}, {where}",
                                "quantization.backend: modelopt for the PyTorch path, or a "
                                "scheme kiln exports for the engine path"))  # fmt: skip
    why = group_problem(algo, scheme.spec.group_size)
    if why is not None:
        sizes = " or ".join(map(str, group_sizes(algo)))
        problems.append(Problem("quantization.group_size", f"quantization.{why} ({target_name})",
                                f"set quantization.group_size to {sizes}"))  # fmt: skip
    return problems
