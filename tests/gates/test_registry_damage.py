"""A registry whose data pages are damaged (page 1, the schema, intact: it opens) is refused
by every command as exit 2 naming the file and what to do, never as an internal error; and
the attempt changes nothing in it."""

from __future__ import annotations

import hashlib
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.gates.releases import Registry
from kiln.runtime.base.errors import UsageError
from tests.gates.conftest import build_artifact
from tests.gates.test_registry import verdict_for

SOURCE = "f" * 64


def damage_data_pages(path: Path) -> None:
    """Overwrite the root page of every table and index: pages 2 and on, where the rows are."""
    with closing(sqlite3.connect(path)) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
        roots = [p for (p,) in db.execute("SELECT rootpage FROM sqlite_master WHERE rootpage > 1")]
    assert roots and path.stat().st_size > size
    with path.open("r+b") as file:
        for page in roots:
            file.seek((page - 1) * size)
            file.write(b"\xa5" * size)


@pytest.fixture
def arts(tmp_path: Path) -> list[Path]:
    return [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(3)]


@pytest.fixture
def damaged(tmp_path: Path, arts: list[Path]) -> Path:
    """A registry with a channel, two promotions and three gate runs, then damaged."""
    path = tmp_path / "registry.db"
    with Registry(path) as registry:
        registry.configure_channel("prod", "fixed", SOURCE)
        for art in arts:
            registry.record_gate_run(verdict_for(art, SOURCE, True), art)
        for art in arts[:2]:
            registry.promote(art, "prod", "release")
    damage_data_pages(path)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "command",
    [
        ["registry", "ls"],
        ["registry", "history", "prod"],
        ["registry", "channel", "prod"],
        ["registry", "channel", "staging", "--rule", "fixed", "--baseline", SOURCE],
        ["promote", "ARTIFACT", "--channel", "prod"],
        ["rollback", "prod"],
    ],
    ids=lambda c: "-".join(c[:2]),
)
def test_every_registry_command_exits_2_naming_the_damaged_file(
    damaged: Path, arts: list[Path], command: list[str]
) -> None:
    before = sha256(damaged)
    args = [str(arts[2]) if a == "ARTIFACT" else a for a in command]
    result = CliRunner().invoke(main, [*args, "--registry", str(damaged)])
    assert result.exit_code == 2, result.output
    assert f"registry {damaged}: the file is damaged" in result.output
    assert "artifacts are not in this file" in result.output
    assert "Restore it from a backup" in result.output and "fresh registry" in result.output
    assert "internal error" not in result.output
    assert sha256(damaged) == before
    assert sorted(p.name for p in damaged.parent.glob("registry.db*")) == ["registry.db"]


def test_recording_a_gate_run_in_a_damaged_registry_names_it(
    damaged: Path, arts: list[Path]
) -> None:
    """What `kiln gate` does once its verdict is in."""
    before = sha256(damaged)
    with Registry(damaged) as registry, pytest.raises(UsageError, match="the file is damaged"):
        registry.record_gate_run(verdict_for(arts[2], "e" * 64, True), arts[2])
    assert sha256(damaged) == before
