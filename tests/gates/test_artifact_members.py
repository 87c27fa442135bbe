"""Only what an artifact holds is read: every path its manifest names stays inside it, and
only regular files are read, so a FIFO, a link or a dangling link in an artifact (or a
model directory) is refused with its name instead of hanging or failing as an internal
error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.engine.core import Engine
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact.verified import verify_artifact
from tests.gates.conftest import build_artifact

# A bounded wait for the CLI in a child process: a hang fails the test instead of the suite.
WAIT_S = 120


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def _edit_manifest(art: Path, change: dict) -> None:
    path = art / artifact.MANIFEST
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("draft", ["/etc", "../elsewhere", "draft/../../x"])
def test_a_manifest_naming_a_draft_outside_the_artifact_is_refused(
    tmp_path: Path, tiny_llama: Path, draft: str
) -> None:
    art = build_artifact(tmp_path / "arts", model_dir=tiny_llama)
    _edit_manifest(art, {"speculative": {"method": "draft", "max_draft_len": 2, "draft": draft}})
    with pytest.raises(ArtifactError, match=r"speculative\.draft"):
        artifact.load_manifest(art)
    result = CliRunner().invoke(main, ["serve", str(art), "--backend", "native"])
    assert result.exit_code == 3 and "speculative.draft" in result.output


def test_a_draft_reached_through_a_link_out_of_the_artifact_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "art"
    root.mkdir()
    (root / "draft").symlink_to(tmp_path)
    with pytest.raises(ArtifactError, match="symbolic link"):
        artifact.member_path(root, "draft", "speculative.draft")
    assert artifact.member_path(root, "model/x", "files") == root / "model" / "x"


def test_a_fifo_in_an_artifact_fails_verification_and_is_not_served(
    tmp_path: Path, tiny_llama: Path
) -> None:
    art = build_artifact(tmp_path / "arts", model_dir=tiny_llama)
    verify_artifact(art)  # a fast check would now trust it
    os.mkfifo(art / "model" / "extra.safetensors")
    assert "model/extra.safetensors: a FIFO, not a regular file" in artifact.verify(art)
    with pytest.raises(ArtifactError, match=r"extra\.safetensors: a FIFO"):
        verify_artifact(art, mode="fast")
    serve = [sys.executable, "-m", "kiln.compiler.cli", "serve", str(art), "--verify", "full"]
    done = subprocess.run(serve, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 3 and "a FIFO" in done.stderr


def test_a_dangling_link_in_an_artifact_fails_verification(tmp_path: Path) -> None:
    art = build_artifact(tmp_path / "arts")
    (art / "model" / "gone.bin").symlink_to(tmp_path / "nowhere")
    problems = artifact.verify(art)
    assert any(p.startswith("model/gone.bin: a symbolic link") for p in problems)


def test_a_model_directory_holding_a_fifo_is_refused_by_name(
    tmp_path: Path, tiny_llama: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_llama.iterdir():
        (model / f.name).symlink_to(f)  # a hub snapshot is links: those are read through
    os.mkfifo(model / "tokenizer_extra.json")
    with pytest.raises(ArtifactError, match=r"tokenizer_extra\.json: a FIFO"):
        Engine.from_pretrained(model)
    (model / "tokenizer_extra.json").unlink()
    (model / "dangling.json").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ArtifactError, match=r"dangling\.json: a dangling link"):
        Engine.from_pretrained(model)


def test_validate_refuses_a_fifo_recipe_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    validate = [sys.executable, "-m", "kiln.compiler.cli", "validate", str(fifo)]
    done = subprocess.run(validate, capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 2 and "a FIFO, not a regular file" in done.stderr
