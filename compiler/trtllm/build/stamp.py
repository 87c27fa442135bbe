"""The stamp that ties an engine to the GPU and TensorRT version it was built with
(`kiln-engine.json`): written after a build, read before an engine is served. A TensorRT
engine runs only on the compute capability and TensorRT version it was built with ("engine
plan file is generated on an incompatible device")."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln.compiler.trtllm.build.host import BuildEnvironment, parse_compute_capability
from kiln.compiler.trtllm.build.plan import BuildPlan

ENGINE_STAMP = "kiln-engine.json"


def write_stamp(plan: BuildPlan, env: BuildEnvironment) -> Path:
    gpu = next(g for g in env.gpus if g.compute_capability == plan.target.compute_capability)
    config = json.loads((plan.engine_dir / "config.json").read_text())
    stamp = {
        "format": "kiln-engine/1",
        "target": plan.target.name,
        "role": plan.role,
        "sm": plan.target.sm,
        "compute_capability": "{}.{}".format(*gpu.compute_capability),
        "gpu_name": gpu.name,
        "driver_version": gpu.driver_version,
        "tensorrt_version": env.tensorrt,
        "tensorrt_llm_version": env.tensorrt_llm,
        "engine_config_version": config.get("version"),  # what trtllm-build itself wrote
        "cuda_version": env.cuda,
        "command": plan.command,
        "argv": list(plan.argv),
        "engine_files": sorted(p.name for p in plan.engine_dir.iterdir()),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    path = plan.engine_dir / ENGINE_STAMP
    path.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def read_engine_stamp(engine_dir: Path) -> dict[str, Any] | None:
    """The `kiln-engine.json` of an engine directory, or None if it has none."""
    path = Path(engine_dir) / ENGINE_STAMP
    return json.loads(path.read_text()) if path.is_file() else None


def check_engine_compatible(
    engine_dir: Path, found_gpu_cc: tuple[int, int] | str, found_trt_version: str | None
) -> list[str]:
    """Why the engine in `engine_dir` cannot run on this GPU and TensorRT (empty: it can).

    A TensorRT engine runs only on the compute capability and TensorRT version it was built
    with ("engine plan file is generated on an incompatible device").
    """
    stamp = read_engine_stamp(engine_dir)
    if stamp is None:
        return [f"{engine_dir} has no {ENGINE_STAMP}: no finished kiln build — run its "
                "build.sh on a builder with the target GPU"]  # fmt: skip
    cc = found_gpu_cc if isinstance(found_gpu_cc, tuple) else parse_compute_capability(found_gpu_cc)
    here = "sm{}{}".format(*cc)
    built = f"engine built for {stamp['sm']} with TensorRT {stamp['tensorrt_version']}"
    fix = f"rebuild with `{stamp['command']}`"
    problems = []
    if parse_compute_capability(stamp["compute_capability"]) != cc:
        problems.append(f"{built}; this GPU is {here} — {fix}")
    trt = stamp.get("tensorrt_version")
    if found_trt_version is None:
        problems.append(f"{built}; TensorRT is not installed here — install TensorRT {trt}")
    elif trt and found_trt_version.split(".")[:3] != trt.split(".")[:3]:
        problems.append(f"{built}; this machine has TensorRT {found_trt_version} — "
                        f"install TensorRT {trt} or {fix}")  # fmt: skip
    return problems
