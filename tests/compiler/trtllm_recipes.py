"""Tiny recipes for one quantisation scheme and one GPU target, and a compile that returns
the artifact with its checkpoint and trtllm-serve options checked against the conformance
rules (compiler/trtllm/rules/checkpoint.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint
from kiln.compiler.trtllm.rules.serve_options import check_serve_options
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from tests.compiler.test_compile import kiln


def quantised_per_arch(
    tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path], spec: QuantSpec, label: str
) -> Callable[[str], Path]:
    """arch -> `models[arch]` quantised as `spec` (4 x 32 calibration tokens), made once."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = tmp_path_factory.mktemp(f"{label}-{arch}")
            quantize(
                models[arch],
                resolve(spec),
                CalibrationSpec(num_samples=4, max_seq_len=32),
                made[arch],
            )
        return made[arch]

    return get


def quantised_per_mode(
    tmp_path_factory: pytest.TempPathFactory,
    models: dict[str, Path],
    specs: dict[str, QuantSpec],
    calibration: CalibrationSpec,
) -> Callable[[str, str], Path]:
    """(arch, mode) -> `models[arch]` quantised as `specs[mode]`, made once, on demand."""
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, mode: str) -> Path:
        if (arch, mode) not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{mode}")
            quantize(models[arch], resolve(specs[mode]), calibration, out)
            made[arch, mode] = out
        return made[arch, mode]

    return get


def scheme_recipe(
    tmp_path: Path, model: Path, quantization: dict[str, Any], target: str, path: str = "both"
) -> Path:
    """A recipe quantising `model` as `quantization` says, for `target` on `path`."""
    recipe = {
        "name": f"tiny-{quantization['method']}",
        "model": {"source": str(model)},
        "quantization": quantization,
        "calibration": {"dataset": "builtin:licenses", "num_samples": 4, "max_seq_len": 32},
        "report": {"num_samples": 4, "max_seq_len": 32},
        "targets": [target],
        "deploy": {"trtllm_path": path},
        "output": "out",
    }
    out = tmp_path / "recipe.yaml"
    out.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return out


def compile_conforming(recipe: Path, target: str) -> tuple[dict[str, str], Path]:
    """`kiln compile --json` of `recipe`: (target's path status, artifact), after checking that
    every exported checkpoint and the target's trtllm-serve options obey the rules."""
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    result = json.loads(stdout.splitlines()[-1])  # ModelOpt prints its own lines first
    artifact = Path(result["artifact"])
    for rank0 in artifact.glob("**/rank0.safetensors"):
        assert check_checkpoint(rank0.parent) == [], rank0.parent
    options = yaml.safe_load((artifact / "engines" / target / "trtllm-serve.yaml").read_text())
    assert check_serve_options(options) == []
    return result["targets"][target], artifact
