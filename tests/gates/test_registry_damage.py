"""A registry whose data pages are damaged (page 1, the schema, intact: it opens) is refused
by every command as exit 2 naming the file and what to do, never as an internal error; and
the attempt changes nothing in it."""

from __future__ import annotations

import hashlib
import json
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
    # found as it opens
    with pytest.raises(UsageError, match="the file is damaged"), Registry(damaged) as registry:
        registry.record_gate_run(verdict_for(arts[2], "e" * 64, True), arts[2])
    assert sha256(damaged) == before


def _registry_with_a_passing_run(tmp_path: Path, art: Path) -> Path:
    path = tmp_path / "one.db"
    with Registry(path) as registry:
        registry.record_gate_run(verdict_for(art, SOURCE, True), art)
    return path


def _ls(path: Path) -> str:
    result = CliRunner().invoke(main, ["registry", "ls", "--registry", str(path)])
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.output
    return " ".join(result.output.split())


def test_a_page_that_reads_back_as_no_rows_is_found_when_the_registry_opens(
    tmp_path: Path, arts: list[Path]
) -> None:
    """One table's page overwritten: a query would read it as an empty table (no channels,
    no runs) rather than fail; the check at open finds it."""
    path = _registry_with_a_passing_run(tmp_path, arts[0])
    with Registry(path) as registry:
        registry.configure_channel("prod", "fixed", SOURCE)
    with closing(sqlite3.connect(path)) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
        (page,) = db.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'channels'"
        ).fetchone()
    with path.open("r+b") as file:
        file.seek((page - 1) * size + 8)
        file.write(bytes(range(256)) * ((size - 8) // 256))
    said = _ls(path)
    assert f"registry {path}:" in said and "damaged" in said


def test_text_that_is_no_utf8_is_damage_not_an_internal_error(
    tmp_path: Path, arts: list[Path]
) -> None:
    path = _registry_with_a_passing_run(tmp_path, arts[0])
    with closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE gate_runs SET created_at = CAST(X'ff24496e' AS TEXT)")
        db.commit()
    said = _ls(path)
    assert f"registry {path}: the file is damaged (Could not decode to UTF-8" in said


@pytest.mark.parametrize(
    ("verdict", "why"),
    [
        ('{"passed": true, "candid', "cannot be read (JSONDecodeError)"),
        ("FLIP", "says passed=False of"),
    ],
)
def test_a_run_marked_passed_against_its_own_verdict_promotes_nothing(
    tmp_path: Path, arts: list[Path], verdict: str, why: str
) -> None:
    """The `passed` column alone never allows a promotion: the verdict stored with the run
    must say the same of the same candidate and baseline."""
    path = _registry_with_a_passing_run(tmp_path, arts[0])
    with closing(sqlite3.connect(path)) as db:
        if verdict == "FLIP":
            (text,) = db.execute("SELECT verdict FROM gate_runs").fetchone()
            verdict = json.dumps({**json.loads(text), "passed": False})
        db.execute("UPDATE gate_runs SET verdict = ?", (verdict,))
        db.commit()
    assert why in _ls(path)
    result = CliRunner().invoke(
        main, ["promote", str(arts[0]), "--channel", "prod", "--registry", str(path)]
    )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"registry {path}: its gate run 1 is marked passed, but the verdict" in said
    assert why in said and "edited or damaged" in said
    with Registry(path) as registry:
        assert registry.ls() == []  # nothing was promoted
