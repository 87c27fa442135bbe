"""What is on the output's disk already: the stages the stage cache holds for this compile
(their keys computed as compiler/pipeline.py and compiler/compile.py compute them), and what
killed runs left, which the compile removes before its stages run (compiler/leftovers.py)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.leftovers import OUTPUT_TEMPORARIES
from kiln.compiler.pipeline import ModelJob, calibration_inputs
from kiln.compiler.stages import StageCache, input_key
from kiln.runtime.base.versions import COMPILE_TOOLS, versions


def stage_keys(job: ModelJob, cache_dir: Path) -> dict[str, str] | None:
    """Each of `job`'s stage keys, as compiler/pipeline.py computes them; None where the stage
    cache holds none of its stages (then nothing is hashed)."""
    names = ["source", "quantize", "report", *(f"export-tp{tp}" for tp in job.tps)]
    if cache_dir.is_symlink() or not any((cache_dir / job.stage(n)).is_dir() for n in names):
        return None
    digest = sources.source_digest(job.source)
    needs_data = job.imported is None and job.scheme.needs_calibration
    calib = calibration_inputs(job.calibration, needs_data)
    tools = versions(COMPILE_TOOLS)
    quant = input_key("quantize", digest, dataclasses.asdict(job.scheme.spec), calib, tools)
    keys = {job.stage("source"): input_key("source", digest), job.stage("quantize"): quant}
    if job.report is not None:
        report = calibration_inputs(job.report, True)
        keys[job.stage("report")] = input_key("report", quant, calib, report)
    for tp in job.tps:
        keys[job.stage(f"export-tp{tp}")] = input_key("export", quant, tp)
    return keys


def packaged(keys: dict[str, str] | None, resolved: dict[str, Any], cache_dir: Path) -> bool:
    """Whether the package stage of these stage keys is cached and its artifact is there
    (compiler/compile.py keys it by its stages' keys, the recipe and the tools)."""
    if keys is None:
        return False
    key = input_key("package", list(keys.values()), resolved, versions(COMPILE_TOOLS))
    found = StageCache(cache_dir).lookup("package", key)
    return found is not None and Path(found.record.get("artifact", "")).is_dir()


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory to be made would be)."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def _matches(root: Path, pattern: Iterable[str]) -> list[Path]:
    """Paths under `root` matching one glob per component, never through a symbolic link."""
    found = [root]
    for part in pattern:
        found = [
            Path(entry.path)
            for folder in found
            if folder.is_dir() and not folder.is_symlink()
            for entry in _entries(folder)
            if fnmatchcase(entry.name, part)
        ]
    return found


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(folder))
    except OSError:  # removed meanwhile (a live run's temporary): nothing to count
        return []


def _du(path: Path) -> int:
    """Bytes `path` holds on disk, its links not followed (what vanishes meanwhile: none)."""
    paths = [path] + [Path(d) / n for d, dirs, files in os.walk(path) for n in (*dirs, *files)]
    total = 0
    for each in paths:
        try:
            total += each.lstat().st_blocks * 512
        except OSError:
            continue
    return total


def leftover_bytes(output: Path) -> int:
    """Bytes of what killed runs left under `output` (the sweep removes them first)."""
    return sum(_du(p) for pattern in OUTPUT_TEMPORARIES for p in _matches(output, pattern))
