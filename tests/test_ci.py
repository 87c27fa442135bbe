"""The CI entry point installs the browser the report test needs, or stops loudly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENSURE = Path(__file__).parents[1] / ".ci" / "ensure-chromium"


def ensure(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(ENSURE)], env={"PATH": str(path)}, capture_output=True, text=True
    )


def bin_with(tmp_path: Path, *commands: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in commands:
        os.symlink(f"/usr/bin/{name}", folder / name)
    return folder


def test_ci_runs_the_browser_check_before_the_suite() -> None:
    run = (ENSURE.parent / "run").read_text()
    assert run.index(".ci/ensure-chromium") < run.index("make test")
    assert "KILN_CI=1" in run


def test_an_installed_chromium_is_left_alone(tmp_path: Path) -> None:
    folder = bin_with(tmp_path, "id")
    (folder / "chromium").write_text("#!/bin/sh\n")
    (folder / "chromium").chmod(0o755)
    done = ensure(folder)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_without_a_way_to_install_it_fails_loudly(tmp_path: Path) -> None:
    # No chromium, no apt-get, no sudo: as root or not, nothing can install it.
    done = ensure(bin_with(tmp_path, "id"))
    assert done.returncode == 1
    assert "chromium is missing" in done.stderr and "apt-get install chromium" in done.stderr
