"""The registry: promotion needs a passing gate run against the channel's baseline."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kiln.gates.releases import Registry, registry_path
from kiln.runtime.base.errors import ArtifactError, UsageError, VerdictFailure
from kiln.runtime.formats.artifact import load_manifest
from tests.gates.conftest import build_artifact

REPO = Path(__file__).resolve().parents[2]


def verdict_for(
    candidate: Path, baseline: str, passed: bool, kind: str = "source"
) -> dict[str, Any]:
    digest = load_manifest(candidate).digest
    return {
        "passed": passed,
        "candidate": {"kind": "artifact", "digest": digest, "name": "demo"},
        "baseline": {"kind": kind, "digest": baseline, "name": "base"},
        "checks": [],
    }


def digest(path: Path) -> str:
    return load_manifest(path).digest


@pytest.fixture
def arts(tmp_path: Path) -> list[Path]:
    return [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(3)]


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    with Registry(tmp_path / "registry.db") as registry:
        yield registry


def test_an_ungated_artifact_is_refused_and_nothing_changes(
    reg: Registry, arts: list[Path]
) -> None:
    with pytest.raises(UsageError) as err:
        reg.promote(arts[0], "prod", "first release")
    message = err.value.message
    assert str(arts[0]) in message and "prod" in message
    assert f"kiln gate {arts[0]} --baseline" in message
    assert reg.ls() == []  # the refused promotion did not even create the channel
    assert reg.history("prod") == [] and reg.artifacts() == []


def test_an_empty_channel_accepts_a_pass_against_any_baseline(
    reg: Registry, arts: list[Path]
) -> None:
    reg.record_gate_run(verdict_for(arts[0], "f" * 64, True, kind="source"), arts[0])
    event = reg.promote(arts[0], "prod", "first release", actor="ci")
    assert event["action"] == "promote" and event["previous_digest"] is None
    state = reg.channel("prod")
    assert state is not None and state.current_digest == digest(arts[0])
    assert state.current_name == "m0"


def test_a_failing_gate_run_refuses_with_exit_code_1(reg: Registry, arts: list[Path]) -> None:
    reg.record_gate_run(verdict_for(arts[0], "f" * 64, False), arts[0])
    with pytest.raises(VerdictFailure, match="failed") as err:
        reg.promote(arts[0], "prod")
    assert err.value.exit_code == 1


def test_a_busy_channel_needs_a_pass_against_what_it_serves(
    reg: Registry, arts: list[Path]
) -> None:
    reg.record_gate_run(verdict_for(arts[0], "f" * 64, True), arts[0])
    reg.promote(arts[0], "prod")
    # gated against the float source, but prod now serves arts[0]
    reg.record_gate_run(verdict_for(arts[1], "f" * 64, True), arts[1])
    with pytest.raises(UsageError) as err:
        reg.promote(arts[1], "prod")
    message = err.value.message
    assert digest(arts[0])[:12] in message and f"--baseline {arts[0].resolve()}" in message
    assert reg.channel("prod").current_digest == digest(arts[0])  # type: ignore[union-attr]
    assert len(reg.history("prod")) == 1
    reg.record_gate_run(verdict_for(arts[1], digest(arts[0]), True, kind="artifact"), arts[1])
    event = reg.promote(arts[1], "prod", "better")
    assert event["previous_digest"] == digest(arts[0])


def test_a_fixed_baseline_channel_ignores_what_it_serves(reg: Registry, arts: list[Path]) -> None:
    reg.configure_channel("staging", "fixed", "f" * 64)
    reg.record_gate_run(verdict_for(arts[0], "e" * 64, True), arts[0])
    with pytest.raises(UsageError, match="its fixed baseline"):
        reg.promote(arts[0], "staging")
    for art in arts[:2]:
        reg.record_gate_run(verdict_for(art, "f" * 64, True), art)
        reg.promote(art, "staging")
    assert reg.channel("staging").current_digest == digest(arts[1])  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="needs a baseline digest"):
        reg.configure_channel("x", "fixed")


def test_a_damaged_artifact_is_refused_before_anything_else(
    reg: Registry, arts: list[Path]
) -> None:
    reg.record_gate_run(verdict_for(arts[0], "f" * 64, True), arts[0])
    (arts[0] / "model" / "w.bin").write_bytes(b"tampered")
    with pytest.raises(ArtifactError, match="does not verify"):
        reg.promote(arts[0], "prod")
    assert reg.history("prod") == []


def test_rollback_walks_back_through_history(reg: Registry, arts: list[Path]) -> None:
    reg.configure_channel("prod", "fixed", "f" * 64)
    for art in arts:
        reg.record_gate_run(verdict_for(art, "f" * 64, True), art)
        reg.promote(art, "prod")
    d = [digest(a) for a in arts]
    assert reg.rollback("prod", "regression")["digest"] == d[1]
    assert reg.rollback("prod")["digest"] == d[0]
    with pytest.raises(UsageError, match="nothing to roll back to"):
        reg.rollback("prod")
    assert reg.channel("prod").current_digest == d[0]  # type: ignore[union-attr]
    actions = [(e["action"], e["digest"], e["previous_digest"]) for e in reg.history("prod")]
    assert actions[-2:] == [("rollback", d[1], d[2]), ("rollback", d[0], d[1])]
    with pytest.raises(UsageError, match="no such channel"):
        reg.rollback("nope")


def test_registry_urls_and_paths() -> None:
    assert registry_path("sqlite:////abs/r.db") == Path("/abs/r.db")
    assert registry_path("sqlite:///rel/r.db") == Path("rel/r.db")
    assert registry_path("/x/y.db") == Path("/x/y.db")
    with pytest.raises(UsageError, match="only SQLite"):
        registry_path("postgresql://host/db")


_PROMOTER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kiln.gates.releases import Registry
    from kiln.runtime.base.errors import KilnError
    db, art, go = sys.argv[1:4]
    registry = Registry(db)
    while not Path(go).exists():
        time.sleep(0.005)
    try:
        registry.promote(art, "prod", "race")
        print("promoted")
    except KilnError as exc:
        print("refused:", exc.message)
    """
)


def test_two_processes_promoting_at_once_serialise(tmp_path: Path, arts: list[Path]) -> None:
    db = tmp_path / "registry.db"
    with Registry(db) as reg:
        for art in arts[:2]:  # each gated only against the float source
            reg.record_gate_run(verdict_for(art, "f" * 64, True), art)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROMOTER, str(db), str(art), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for art in arts[:2]
    ]
    time.sleep(1.0)  # both processes are up and waiting
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = sorted(out.strip().split(":")[0] for out, _ in outs)
    # the first wins the empty channel; the second is judged against the winner and refused
    assert results == ["promoted", "refused"], outs
    with Registry(db) as reg:
        history = reg.history("prod")
        assert len(history) == 1
        assert reg.channel("prod").current_digest == history[0]["digest"]  # type: ignore[union-attr]
        check = reg._db.execute("PRAGMA integrity_check").fetchone()[0]
        assert check == "ok"


def test_an_empty_channel_does_not_open_with_a_pass_against_another_artifact(
    reg: Registry, arts: list[Path]
) -> None:
    reg.record_gate_run(verdict_for(arts[1], digest(arts[0]), True, kind="artifact"), arts[1])
    reg.record_gate_run(verdict_for(arts[1], "http://elsewhere:8000", True, kind="http"), arts[1])
    with pytest.raises(UsageError) as refused:
        reg.promote(arts[1], "prod")
    message = refused.value.message
    assert "serves nothing yet" in message and "float source" in message
    assert f"artifact {digest(arts[0])[:12]}" in message
    assert reg.ls() == [] and reg.history("prod") == []
    reg.record_gate_run(verdict_for(arts[1], "f" * 64, True, kind="source"), arts[1])
    assert reg.promote(arts[1], "prod")["digest"] == digest(arts[1])


def test_a_gate_run_is_bound_to_its_candidate_and_never_to_itself(
    reg: Registry, arts: list[Path]
) -> None:
    own = digest(arts[0])
    with pytest.raises(UsageError, match="baseline is the candidate itself"):
        reg.record_gate_run(verdict_for(arts[0], own, True, kind="artifact"), arts[0])
    with pytest.raises(UsageError, match=f"the verdict is for {own[:12]}"):
        reg.record_gate_run(verdict_for(arts[0], "f" * 64, True), arts[1])
    assert reg.gate_runs() == [] and reg.artifacts() == []
