"""`python -m kiln.quant.reference FLOAT_DIR DIR PARENT_PID`: the report's float
log-probabilities of the token ids in DIR/samples.json, written into DIR
(quant/layer_report.py `float_reference`).

`kiln compile` starts it beside the quantisation (compiler/pipeline.py): the float model's half
of the report depends only on the source and the held-out text, so it runs while the quantiser
calibrates, in a process of its own, sharing none of the libraries' process-wide state (the
tracing and initialisation patches a quantiser applies while it works); the report then runs
only the quantised model. It ends when PARENT_PID (the compile) does, however that ends.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

SAMPLES_FILE = "samples.json"
POLL_S = 0.5


def _end_with(parent: int) -> None:
    """Exit at once when `parent` is no longer this process's parent (it ended)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kiln-parent-watch").start()


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


if __name__ == "__main__":
    _end_with(int(sys.argv[3]))
    compute(Path(sys.argv[1]), Path(sys.argv[2]))
