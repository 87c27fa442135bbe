"""Engines a builder writes into a published artifact (`engines/<target>/engine/`) lie
outside its digest; once recorded (`kiln inspect --record-engines`) they are verified like
every other file, so a tampered engine is caught, and the artifact keeps its digest."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kiln.compiler.serving import resolve_model
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact.verified import verify_artifact
from tests.compiler.test_compile import kiln
from tests.gates.conftest import build_artifact

ENGINE = "engines/h100-sxm/engine"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Verification stamps in this test's own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def built_later(root: Path) -> Path:
    """What a builder's build.sh leaves in a published artifact: an engine directory."""
    engine = root / ENGINE
    engine.mkdir(parents=True)
    (engine / "config.json").write_text('{"version": "1.2.0"}')
    (engine / "rank0.engine").write_bytes(b"\x00plan" * 1024)
    return root


def tamper(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[0] ^= 0xFF
    file.write_bytes(bytes(data))


def test_a_recorded_engine_is_verified_and_a_tampered_one_is_refused(tmp_path: Path) -> None:
    root = built_later(build_artifact(tmp_path / "arts"))
    digest = artifact.load_manifest(root).digest
    assert verify_artifact(root).built_later == (ENGINE,)  # unrecorded: not verified

    manifest = artifact.record_engines(root)

    assert sorted(manifest.engines) == [f"{ENGINE}/config.json", f"{ENGINE}/rank0.engine"]
    assert manifest.digest == digest and root.name.endswith(digest[:12])
    assert artifact.verify(root) == []
    assert verify_artifact(root).built_later == ()
    tamper(root / ENGINE / "rank0.engine")
    (problem,) = artifact.verify(root)
    assert problem.startswith(f"{ENGINE}/rank0.engine: sha256")
    with pytest.raises(ArtifactError, match=r"rank0\.engine"):
        verify_artifact(root, action="serve it")


def test_serving_an_unrecorded_engine_warns_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = built_later(build_artifact(tmp_path / "arts"))
    with caplog.at_level(logging.WARNING):
        resolve_model(str(root), None)
    assert f"{ENGINE} was built after publication" in caplog.text
    assert f"kiln inspect --record-engines {root}" in caplog.text

    artifact.record_engines(root)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve_model(str(root), None)
    assert "built after publication" not in caplog.text


def test_an_artifact_without_later_engines_writes_no_engines_section(tmp_path: Path) -> None:
    # A nested artifact's manifest is one of its parent's files: an empty section would
    # change every parent's digest.
    root = build_artifact(tmp_path / "arts")
    artifact.record_engines(root)
    assert "engines" not in json.loads((root / artifact.MANIFEST).read_text())


def test_kiln_inspect_records_engines_and_verify_catches_a_tampered_one(tmp_path: Path) -> None:
    root = built_later(build_artifact(tmp_path / "arts"))
    code, _, stderr = kiln("inspect", str(root), "--verify")
    assert code != 0 and "--record-engines" in stderr  # unrecorded: named, with the fix

    code, _, stderr = kiln("inspect", str(root), "--record-engines", "--verify")
    assert code == 0, stderr
    assert "recorded 2 engine file(s)" in stderr

    tamper(root / ENGINE / "config.json")
    code, _, stderr = kiln("inspect", str(root), "--verify")
    assert code != 0 and f"{ENGINE}/config.json: sha256" in stderr


def test_republishing_the_same_content_keeps_the_recorded_engines(tmp_path: Path) -> None:
    root = built_later(build_artifact(tmp_path / "arts"))
    artifact.record_engines(root)

    assert build_artifact(tmp_path / "arts") == root  # the same content, published again

    assert sorted(artifact.load_manifest(root).engines) == [
        f"{ENGINE}/config.json",
        f"{ENGINE}/rank0.engine",
    ]
    assert artifact.verify(root) == []
