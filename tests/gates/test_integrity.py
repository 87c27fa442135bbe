"""What is served, gated, promoted or rolled back to is what its digest names: every one of
those checks the artifact against its manifest first, and a channel's recorded digest
against the artifact's."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.serving import resolve_model
from kiln.gates.releases import Registry
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact.verified import RACY_S, verify_artifact
from tests.gates.conftest import baseline_responder, build_artifact, write_traffic


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Verification stamps in this test's own cache folder."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def _aged(root: Path) -> Path:
    """Wait until every file of `root` changed longer ago than the stamp's racy window, so a
    stamp may cover them (a wait on the clock, not on the machine's speed)."""
    newest = max(p.stat().st_ctime_ns for p in root.rglob("*") if p.is_file())
    time.sleep(max(0.0, newest / 1e9 + RACY_S + 0.05 - time.time()))
    return root


def _tamper_same_size_and_mtime(file: Path) -> None:
    """Flip one byte, keeping the size and giving the old mtime back."""
    st = file.stat()
    data = bytearray(file.read_bytes())
    data[0] ^= 0xFF
    file.write_bytes(bytes(data))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))


def _promoted(registry: Registry, arts: list[Path], channel: str = "prod") -> None:
    """Promote each artifact in turn, each gated against the one before it."""
    baseline = "f" * 64
    for art in arts:
        candidate = artifact.load_manifest(art).digest
        verdict = {
            "passed": True,
            "candidate": {"kind": "artifact", "digest": candidate, "name": art.name},
            "baseline": {"kind": "source" if baseline == "f" * 64 else "artifact",
                         "digest": baseline, "name": "base"},
            "checks": [],
        }  # fmt: skip
        registry.record_gate_run(verdict, art)
        registry.promote(art, channel)
        baseline = candidate


def test_an_unchanged_artifact_is_trusted_from_its_stamp_and_full_rehashes(
    tmp_path: Path, _own_cache: Path
) -> None:
    art = _aged(build_artifact(tmp_path / "arts"))
    first = verify_artifact(art)
    assert first.hashed and first.manifest.digest == artifact.load_manifest(art).digest
    assert verify_artifact(art).hashed is False
    assert verify_artifact(art, mode="full").hashed is True
    # The stamp is the user's, outside the artifact: its digest and file list are unchanged.
    assert artifact.verify(art) == [] and list(_own_cache.rglob("*.json"))


def test_a_file_changed_behind_the_stamp_is_refused_naming_it(tmp_path: Path) -> None:
    art = _aged(build_artifact(tmp_path / "arts"))
    verify_artifact(art)
    _tamper_same_size_and_mtime(art / "model" / "w.bin")
    with pytest.raises(ArtifactError) as refused:
        verify_artifact(art, action="serve it")
    message = refused.value.message
    assert "refusing to serve it" in message and "model/w.bin: sha256" in message
    assert f"kiln inspect {art} --verify" in message


def test_a_file_added_to_the_artifact_is_refused(tmp_path: Path) -> None:
    art = build_artifact(tmp_path / "arts")
    verify_artifact(art)
    (art / "model" / "chat_template.jinja").write_text("{{ evil }}")
    with pytest.raises(ArtifactError, match=r"chat_template\.jinja: not recorded"):
        verify_artifact(art)


def test_a_tampered_artifact_is_not_served(tmp_path: Path, tiny_llama: Path) -> None:
    art = build_artifact(tmp_path / "arts", model_dir=tiny_llama)
    (art / "model" / "config.json").write_text("{}")
    result = CliRunner().invoke(main, ["serve", str(art), "--backend", "native"])
    assert result.exit_code == 3
    assert "refusing to serve it" in result.output and "model/config.json" in result.output


def test_a_channel_serving_a_tampered_or_replaced_artifact_is_refused(tmp_path: Path) -> None:
    arts = [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(2)]
    db = tmp_path / "registry.db"
    with Registry(db) as registry:
        _promoted(registry, arts[:1])
    served = resolve_model("registry://prod", str(db))
    assert served.digest == artifact.load_manifest(arts[0]).digest
    # The directory the channel points at now holds another artifact, manifest and all.
    shutil.rmtree(arts[0])
    shutil.copytree(arts[1], arts[0])
    with pytest.raises(ArtifactError) as refused:
        resolve_model("registry://prod", str(db))
    message = refused.value.message
    recorded = artifact.load_manifest(arts[1]).digest
    assert "registry records it as" in message and recorded[:12] in message
    assert "refusing to serve it as registry://prod" in message


def test_rollback_onto_a_tampered_artifact_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    arts = [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(2)]
    with Registry(tmp_path / "registry.db") as registry:
        _promoted(registry, arts)
        (arts[0] / "model" / "w.bin").write_bytes(b"tampered")
        with pytest.raises(ArtifactError) as refused:
            registry.rollback("prod", "regression")
        assert "refusing to roll prod back to it" in refused.value.message
        assert "model/w.bin: sha256" in refused.value.message
        state = registry.channel("prod")
        assert state is not None and state.current_digest == artifact.load_manifest(arts[1]).digest
        assert [e["action"] for e in registry.history("prod")] == ["promote", "promote"]


def test_a_tampered_artifact_is_not_gated_and_nothing_is_recorded(
    tmp_path: Path, openai_stub: Any
) -> None:
    art = build_artifact(tmp_path / "arts")
    registered = str(art.resolve())
    copy = shutil.copytree(art, tmp_path / "copy" / art.name)
    (copy / "model" / "w.bin").write_bytes(b"tampered")
    stub = openai_stub(baseline_responder)
    db = tmp_path / "registry.db"
    with Registry(db) as registry:
        registry.record_gate_run(
            {"passed": True, "baseline": {"kind": "source", "digest": "f" * 64},
             "candidate": {"kind": "artifact", "digest": artifact.load_manifest(art).digest},
             "checks": []},
            art,
        )  # fmt: skip
    traffic = write_traffic(tmp_path / "traffic.jsonl")
    args = ["gate", str(copy), "--baseline", stub.url, "--traffic", str(traffic),
            "--registry", str(db), "--out", str(tmp_path / "reports")]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3 and "refusing to gate it as the candidate" in result.output
    assert "model/w.bin" in result.output
    with Registry(db) as registry:
        assert len(registry.gate_runs()) == 1
        assert [a["path"] for a in registry.artifacts()] == [registered]
