"""`kiln compile` holds a layer, not the model (issue: models at the size teams ship): the
same FP8 compile of two random checkpoints of one shape, 2 and 10 decoder layers deep, peaks
within a fraction of the 8 extra layers' bf16 bytes of each other. A stage that held the whole
model, even once and in bf16, would add all of them; tests/benchmarks/scale.py measures the
sizes teams ship."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.scale_models import SHAPES, build, run_measured, weight_bytes

LAYERS = (2, 10)


def _compile_peak(model: Path, work: Path) -> int:
    out = work / model.name
    recipe = {
        "name": f"guard-{model.name}",
        "model": {"source": str(model)},
        "quantization": {"method": "fp8", "activations": "fp8_static", "ignore": ["lm_head"]},
        "calibration": {"dataset": "builtin:licenses", "num_samples": 8, "max_seq_len": 64},
        "report": {"dataset": "builtin:licenses", "num_samples": 4, "max_seq_len": 64},
        "targets": ["h100-sxm"],
        "output": str(out),
    }
    path = work / f"{model.name}.yaml"
    path.write_text(json.dumps(recipe))
    env = {**os.environ, "XDG_CACHE_HOME": str(work / "cache"), "OMP_WAIT_POLICY": "PASSIVE"}
    argv = [sys.executable, "-m", "kiln.compiler.cli", "compile", str(path), "--json"]
    code, peak, stdout, stderr = run_measured(argv, env)
    assert code == 0, stderr[-3000:]
    assert json.loads(stdout)["artifact"]
    return peak


@pytest.mark.slow
def test_compile_memory_does_not_grow_with_the_models_depth(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("compile-memory")
    models = [build(replace(SHAPES["guard-300m"], layers=n), root / f"layers-{n}") for n in LAYERS]
    shallow, deep = (_compile_peak(m, root) for m in models)
    extra = weight_bytes(models[1]) - weight_bytes(models[0])  # the 8 extra layers, bf16
    assert deep - shallow < 0.5 * extra, (
        f"peak RSS {deep / 1e9:.2f} GB at {LAYERS[1]} layers vs {shallow / 1e9:.2f} GB at "
        f"{LAYERS[0]}: {(deep - shallow) / extra:.2f}x the extra layers' bf16 bytes"
    )
    assert deep <= 1.5 * weight_bytes(models[1]) + 2 * 2**30
