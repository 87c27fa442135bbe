"""The report's float half, started beside the quantisation.

The float model's log-probabilities of the held-out text depend only on the source and the
text, not on the quantised model, so `kiln compile` computes them while the quantiser
calibrates: in a process of its own (`python -m kiln.quant.reference`, which shares none of a
quantiser's process-wide patches), into a hidden `.partial` folder beside the report stage's
(a killed run's is swept at the next start, compiler/leftovers.py). The report stage then reads
them and runs only the quantised model (quant/layer_report.py `reference_problem` checks they
are of its samples). Where the quantise stage is cached, or the report's, or the model is
smaller than compiler/pipeline.py's REFERENCE_BESIDE_MIN_PARAMETERS (starting the process would
cost more than the forward), no job is given; where the process fails, the report computes
them itself and says so.

The process is started before its job is known (`start_process`, while a new source is
hashed: its imports take ~3 s of a core the hash leaves idle, rather than of the quantiser's);
`ReferenceProcess.start` hands it the job, `ReferenceProcess.stop` ends it without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kiln.compiler.stages import PARTIAL
from kiln.quant.reference import SAMPLES_FILE

STOP_WAIT_S = 30.0


@dataclass
class ReferenceRun:
    """A float reference being computed: its folder, its process and the process's output."""

    dir: Path
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def result(self, progress: Callable[[str], None]) -> Path | None:
        """Its folder once the process has ended well, else None (said why)."""
        code = self.proc.wait()
        if code == 0:
            return self.dir
        lines = _output(self.log).strip().splitlines()
        last = lines[-1] if lines else "no output"
        progress(f"report: the float log-probabilities computed beside the quantisation "
                 f"failed (exit {code}: {last}); the report computes them")  # fmt: skip
        return None

    def stop(self) -> None:
        """End the process where it still runs, and remove its folder."""
        _end(self.proc, self.log)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class ReferenceProcess:
    """`python -m kiln.quant.reference`, started and waiting for its job on stdin."""

    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def start(
        self, model_dir: Path, samples: list[list[int]], parent: Path, prefix: str
    ) -> ReferenceRun:
        """Hand it the float reference of `samples` on the float checkpoint `model_dir`, to be
        written into a new hidden folder `parent`/`prefix`…`.partial`."""
        try:
            parent.mkdir(parents=True, exist_ok=True)
            where = Path(tempfile.mkdtemp(prefix=prefix, suffix=PARTIAL, dir=parent))
        except BaseException:  # no folder to hand: the process ends here
            self.stop()
            raise
        run = ReferenceRun(where, self.proc, self.log)
        try:
            (where / SAMPLES_FILE).write_text(json.dumps(samples))
            job = {"float_dir": str(model_dir), "out_dir": str(where)}
            stdin = self.proc.stdin
            assert stdin is not None
            with contextlib.suppress(OSError):  # it ended already: `result` says how
                stdin.write(json.dumps(job).encode() + b"\n")
                stdin.close()
        except BaseException:
            run.stop()
            raise
        return run

    def stop(self) -> None:
        """End it without a job (stdin closed: it exits at once, or is ended)."""
        _end(self.proc, self.log)


def start_process() -> ReferenceProcess:
    """`python -m kiln.quant.reference`, importing what it needs while the caller goes on."""
    log = tempfile.TemporaryFile(prefix="kiln-reference-")  # noqa: SIM115 (the process's, closed by `_end`)
    try:
        argv = [sys.executable, "-m", "kiln.quant.reference", str(os.getpid())]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
    except BaseException:
        log.close()
        raise
    return ReferenceProcess(proc, log)


def start_reference(
    model_dir: Path, samples: list[list[int]], parent: Path, prefix: str
) -> ReferenceRun:
    """Start computing the float reference of `samples` on the float checkpoint `model_dir`,
    in a new hidden folder `parent`/`prefix`…`.partial`."""
    return start_process().start(model_dir, samples, parent, prefix)


def _output(log: IO[bytes]) -> str:
    try:
        log.seek(0)
        return log.read().decode(errors="replace")
    except (OSError, ValueError):
        return ""


def _end(proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
    """Close `proc`'s stdin, give it STOP_WAIT_S to end, then kill it; close its log."""
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
