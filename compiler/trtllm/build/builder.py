"""Running a build plan where this machine can (TensorRT-LLM 1.2.x and the target's GPU),
stamping what it built; elsewhere the plan stays `planned` with its `build.sh`."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.compiler.trtllm.build.host import BuildEnvironment, detect_environment
from kiln.compiler.trtllm.build.plan import TRTLLM_LINE, BuildPlan
from kiln.compiler.trtllm.build.stamp import ENGINE_STAMP, write_stamp
from kiln.runtime.formats.artifact import BuildRecord


def why_not_here(plan: BuildPlan, env: BuildEnvironment) -> str | None:
    """Why this machine cannot build `plan` (None: it can)."""
    if env.tensorrt_llm is None:
        return "tensorrt_llm not installed"
    if not env.tensorrt_llm.startswith(TRTLLM_LINE):
        return (f"tensorrt_llm {env.tensorrt_llm} installed; engines need {TRTLLM_LINE}.x "
                "(trtllm-build was removed after it)")  # fmt: skip
    want = plan.target.compute_capability
    matching = [g for g in env.gpus if g.compute_capability == want]
    needed = max(p.world_size for p in plan.plans())
    if len(matching) < needed:
        found = ", ".join(f"{g.name} ({g.sm})" for g in env.gpus) or "none"
        count = f"{needed} GPUs" if needed > 1 else "GPU"
        return f"no {count} with {plan.target.sm} here (found: {found})"
    return None


@dataclass
class BuildOutcome:
    """What running a build plan here did: `built`, `planned` or `failed`, and why, with
    this machine's paths (`record` makes the manifest's BuildRecord of it)."""

    status: str
    target: str
    sm: str
    commands: list[str]
    script: Path
    reason: str | None = None
    stderr_tail: str | None = None
    stamps: list[Path] = field(default_factory=list)

    def record(self, root: Path, commands: list[str]) -> BuildRecord:
        """The manifest's record of this outcome: `commands` as recorded, paths relative to
        the artifact `root`."""
        return BuildRecord(
            status=self.status,
            target=self.target,
            sm=self.sm,
            commands=list(commands),
            script=str(self.script.relative_to(root)),
            reason=self.reason,
            stderr_tail=self.stderr_tail,
            stamps=[str(s.relative_to(root)) for s in self.stamps],
        )


def _missing_engine_files(plan: BuildPlan) -> list[str]:
    names = ["config.json"] + [f"rank{r}.engine" for r in range(plan.world_size)]
    return [n for n in names if not (plan.engine_dir / n).is_file()]


def run_build(
    plan: BuildPlan,
    *,
    trtllm_build: str = "trtllm-build",
    detect: Callable[[], BuildEnvironment] = detect_environment,
    script_path: Path | None = None,
    write_script: bool = True,
) -> BuildOutcome:
    """Build the engines of `plan` where this machine can, and stamp them; else `planned`.

    `built` only when the executable ran and wrote `config.json` and every `rank{N}.engine`.
    `build.sh` is written either way (default: `<engine_dir>/build.sh`).
    """
    script = script_path or plan.engine_dir / "build.sh"
    if write_script:
        plan.write_script(script)
    commands = [p.command for p in plan.plans()]
    record = BuildOutcome("planned", plan.target.name, plan.target.sm, commands, script)
    env = detect()
    exe = shutil.which(trtllm_build)
    record.reason = why_not_here(plan, env) or (
        None if exe else f"{trtllm_build} not found on PATH"
    )
    if record.reason or exe is None:
        return record
    for p in plan.plans():
        (p.engine_dir / ENGINE_STAMP).unlink(missing_ok=True)  # never leave a stale claim
        p.engine_dir.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([exe, *p.argv[1:]], env={**os.environ, **p.env},
                              capture_output=True, text=True, check=False)  # fmt: skip
        missing = _missing_engine_files(p)
        if done.returncode != 0 or missing:
            record.status = "failed"
            record.reason = (f"{p.role} build exited {done.returncode}" if done.returncode
                             else f"{p.role} build exited 0 but {p.engine_dir} lacks "
                             f"{', '.join(missing)}")  # fmt: skip
            record.stderr_tail = "\n".join(done.stderr.splitlines()[-40:])
            return record
        record.stamps.append(write_stamp(p, env))
    record.status = "built"
    return record
