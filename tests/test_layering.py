"""kiln's layering holds, and the check that says so can fail.

runtime imports nothing of ours; quant and gates import only the runtime; compiler imports
all; inside each package its subfolders form layers too (pyproject.toml
`[tool.importlinter]`). No module imports itself back through others, not even through an
import inside a function. Everything is imported under `kiln.`: a bare `import runtime`
would load a second copy of the package under another name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
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


def test_a_planted_back_edge_inside_a_package_breaks_its_layers(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "runtime" / "formats" / "weights.py"
    target.write_text(target.read_text() + "\nfrom kiln.runtime.engine import core  # planted\n")
    result = lint_imports(tree_copy, path=tree_copy)
    assert result.returncode != 0
    assert "kiln.runtime.formats.weights -> kiln.runtime.engine.core" in result.stdout


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every set of kiln modules that import each other round (Tarjan's strongly connected
    components of the import graph, function-level imports included)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules)))
    for module in modules:
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_back() -> None:
    graph = grimp.build_graph(*(f"kiln.{p}" for p in PACKAGES), cache_dir=None)
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_planted_circle(tree_copy: Path) -> None:
    target = tree_copy / "kiln" / "runtime" / "base" / "errors.py"
    planted = "\ndef _late():\n    from kiln.runtime.base import versions  # planted\n"
    target.write_text(target.read_text() + planted)
    versions = tree_copy / "kiln" / "runtime" / "base" / "versions.py"
    versions.write_text(
        versions.read_text() + "\nfrom kiln.runtime.base import errors  # planted\n"
    )
    script = (
        "import grimp, sys; from tests.test_layering import import_cycles; "
        "g = grimp.build_graph('kiln.runtime', cache_dir=None); print(import_cycles(g))"
    )
    env = {**os.environ, "PYTHONPATH": f"{tree_copy}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tree_copy,
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    assert "kiln.runtime.base.errors" in done.stdout and "kiln.runtime.base.versions" in done.stdout
