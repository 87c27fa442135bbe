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


def lint_imports(root: Path, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run import-linter with the contracts in `root`'s pyproject.toml over the kiln packages
    Python finds: the repository's own through the editable install, or a copy on `path`."""
    env = {**os.environ, "PYTHONPATH": str(path)} if path else dict(os.environ)
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
    """A copy of kiln's sources laid out as installed (kiln/<package>), to plant edges in
    without touching the tree other tests import."""
    root = tmp_path / "repo"
    (root / "kiln").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
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
    target = tree_copy / "kiln" / "runtime" / "base" / "errors.py"
    target.write_text(target.read_text() + "\nfrom kiln.compiler import recipe  # planted\n")
    result = lint_imports(tree_copy, path=tree_copy)
    assert result.returncode != 0
    assert "kiln.runtime.base.errors -> kiln.compiler.recipe" in result.stdout


def test_a_planted_edge_between_quant_and_gates_breaks_the_contract(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "quant" / "spec.py"
    target.write_text(target.read_text() + "\nfrom kiln.gates import settings  # planted\n")
    result = lint_imports(tree_copy, path=tree_copy)
    assert result.returncode != 0
    assert "kiln.quant.spec -> kiln.gates.settings" in result.stdout


def test_a_planted_bare_import_breaks_the_contract(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "gates" / "decide" / "rules.py"
    target.write_text(target.read_text() + "\nimport runtime.errors  # planted\n")
    result = lint_imports(tree_copy, path=tree_copy)
    assert result.returncode != 0
    assert "kiln.gates.decide.rules -> runtime" in result.stdout
