"""The report's float half, started beside the quantisation.

The float model's log-probabilities of the held-out text depend only on the source and the
text, not on the quantised model, so `kiln compile` computes them while the quantiser
calibrates: in a process of its own (`python -m kiln.quant.reference`, which shares none of a
quantiser's process-wide patches), into a hidden `.partial` folder beside the report stage's
(a killed run's is swept at the next start, compiler/leftovers.py). The report stage then reads
them and runs only the quantised model (quant/layer_report.py `reference_problem` checks they
are of its samples). Where the quantise stage is cached, or the report's, or the model is
smaller than compiler/pipeline.py's REFERENCE_BESIDE_MIN_PARAMETERS (starting the process would
cost more than the forward), nothing is started; where the process fails, the report computes
them itself and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.compiler.stages import PARTIAL
from kiln.quant.reference import SAMPLES_FILE

LOG_FILE = "reference.log"
STOP_WAIT_S = 30.0


@dataclass
class ReferenceRun:
    """A float reference being computed: its folder and its process."""

    dir: Path
    proc: subprocess.Popen[bytes]

    def result(self, progress: Callable[[str], None]) -> Path | None:
        """Its folder once the process has ended well, else None (said why)."""
        code = self.proc.wait()
        if code == 0:
            return self.dir
        try:
            lines = (self.dir / LOG_FILE).read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = lines[-1] if lines else "no output"
        progress(f"report: the float log-probabilities computed beside the quantisation "
                 f"failed (exit {code}: {last}); the report computes them")  # fmt: skip
        return None

    def stop(self) -> None:
        """End the process where it still runs, and remove its folder."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_reference(
    model_dir: Path, samples: list[list[int]], parent: Path, prefix: str
) -> ReferenceRun:
    """Start computing the float reference of `samples` on the float checkpoint `model_dir`,
    in a new hidden folder `parent`/`prefix`…`.partial`."""
    parent.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix=prefix, suffix=PARTIAL, dir=parent))
    try:
        (where / SAMPLES_FILE).write_text(json.dumps(samples))
        argv = [sys.executable, "-m", "kiln.quant.reference", str(model_dir), str(where),
                str(os.getpid())]  # fmt: skip
        with (where / LOG_FILE).open("wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return ReferenceRun(where, proc)
