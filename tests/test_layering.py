"""kiln's layering holds, and the check that says so can fail.

runtime imports nothing of ours; quant and gates import only the runtime; compiler imports
all (pyproject.toml `[tool.importlinter]`). Everything is imported under `kiln.`: a bare
`import runtime` would load a second copy of the package under another name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("compiler", "quant", "gates", "runtime")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter over the `kiln` package found in `root`, with kiln's contracts."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    script = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(script), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """A copy of kiln's sources with real folders under kiln/ (no links), to plant edges in."""
    root = tmp_path / "repo"
    (root / "kiln").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "kiln" / "__init__.py", root / "kiln" / "__init__.py")
    for name in PACKAGES:
        shutil.copytree(
            REPO / name, root / "kiln" / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    return root


def test_the_layering_contract_is_kept() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.split("Contracts:")[-1].split("kept")[0]


def test_a_planted_back_edge_from_runtime_breaks_the_contract(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "runtime" / "errors.py"
    target.write_text(target.read_text() + "\nfrom kiln.compiler import recipe  # planted\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert "kiln.runtime.errors -> kiln.compiler.recipe" in result.stdout


def test_a_planted_edge_between_quant_and_gates_breaks_the_contract(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "quant" / "spec.py"
    target.write_text(target.read_text() + "\nfrom kiln.gates import config  # planted\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert "kiln.quant.spec -> kiln.gates.config" in result.stdout


def test_a_planted_bare_import_breaks_the_contract(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "gates" / "rules.py"
    target.write_text(target.read_text() + "\nimport runtime.errors  # planted\n")
    result = lint_imports(tree_copy)
    assert result.returncode != 0
    assert "kiln.gates.rules -> runtime" in result.stdout
