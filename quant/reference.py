"""`python -m kiln.quant.reference PARENT_PID`: the report's float log-probabilities
(quant/layer_report.py `float_reference`), computed in a process of its own.

`kiln compile` starts it beside the quantisation (compiler/float_reference.py): the float
model's half of the report depends only on the source and the held-out text, so it runs while
the quantiser calibrates, sharing none of the libraries' process-wide state (the tracing and
initialisation patches a quantiser applies while it works); the report then runs only the
quantised model. The process first imports what the float model needs (torch, transformers and
its model classes: ~3 s of one core), then reads its job from stdin, one JSON line
{"float_dir": FLOAT_DIR, "out_dir": DIR}, and writes the log-probabilities of the token ids in
DIR/samples.json into DIR. So the compile starts it while the source is still being hashed,
when a core is often idle, before it knows whether the float half will be needed: stdin closed
without a job ends it at once, with nothing done. It ends when PARENT_PID (the compile) does,
however that ends.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

from kiln.runtime.base.heap import collection_paused, uncollected_at_exit

SAMPLES_FILE = "samples.json"
POLL_S = 0.5


def _end_with(parent: int) -> None:
    """Exit at once when `parent` is no longer this process's parent (it ended)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kiln-parent-watch").start()


def prepare() -> None:
    """Import what computing the reference needs, before the job is known."""
    from kiln.runtime.base.imports import unused_imports_skipped

    with collection_paused():  # imports: objects that live on, little garbage
        with unused_imports_skipped():  # scikit-learn: 1.3 s of this process's 3.9 s of imports
            from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

        import kiln.quant.layer_report
        import kiln.quant.streamed_model  # noqa: F401
    # Nothing but the imports' objects lives yet, and they live to the end: later collections
    # need not scan them (gc.freeze).
    gc.freeze()


def compute(float_dir: Path, out_dir: Path) -> Path:
    """The float reference of DIR/samples.json's token ids, written into `out_dir`."""
    from kiln.quant.layer_report import float_reference, report_device, report_dtype
    from kiln.quant.streamed_model import float_model
    from kiln.runtime.base.heap import reuse_within_layers

    reuse_within_layers()  # modules are loaded and freed one after another, layer by layer
    samples = json.loads((Path(out_dir) / SAMPLES_FILE).read_text())
    device = report_device()
    model = float_model(Path(float_dir), device, report_dtype(Path(float_dir)))
    return float_reference(model, samples, Path(out_dir), device)


def main(parent: int) -> int:
    uncollected_at_exit()  # it exits while the quantiser calibrates: no core to spare
    _end_with(parent)
    prepare()
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # not needed after all
    job = json.loads(line)
    compute(Path(job["float_dir"]), Path(job["out_dir"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
