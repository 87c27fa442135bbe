"""The output lock and the sweep of what killed runs leave behind: never through a link,
and every stage's temporaries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.compiler.leftovers import holding, sweep_output, sweep_user_cache
from kiln.compiler.stages import CACHE_DIR, LOCK_FILE, StageCache, output_lock
from kiln.runtime.base.errors import UsageError

REPO = Path(__file__).parents[2]


def tree(root: Path) -> set[str]:
    """Every path under root (links not entered), relative."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# --- the lock ---------------------------------------------------------------------------------


def test_a_lock_planted_as_a_symlink_is_refused_and_its_target_left_intact(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    root = tmp_path / "out"
    root.mkdir()
    (root / LOCK_FILE).symlink_to(victim)

    with pytest.raises(UsageError, match="symbolic link") as caught, output_lock(root):
        pass
    assert str(root / LOCK_FILE) in caught.value.message
    assert victim.read_text() == "precious\n"


def test_the_lock_never_truncates_its_file(tmp_path: Path) -> None:
    root = tmp_path / "out"
    root.mkdir()
    # A hard link cannot be told apart from a plain file; opening it must not empty it.
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.link(victim, root / LOCK_FILE)
    with output_lock(root):
        pass
    assert victim.read_text() == "precious\n"


# --- the sweep never follows a link -----------------------------------------------------------


def test_a_symlinked_stage_cache_is_refused_and_not_swept(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "quantize" / ".abc-1.partial").mkdir(parents=True)
    (elsewhere / "quantize" / ".abc-1.partial" / "keep").write_text("x")
    root = tmp_path / "out"
    root.mkdir()
    (root / CACHE_DIR).symlink_to(elsewhere)

    sweep_output(root)
    assert (elsewhere / "quantize" / ".abc-1.partial" / "keep").is_file()
    with pytest.raises(UsageError, match="symbolic link"):
        StageCache(root / CACHE_DIR)


def test_symlinked_entries_are_unlinked_or_skipped_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".abc-1.partial").mkdir(parents=True)
    (elsewhere / ".abc-1.partial" / "keep").write_text("x")
    (elsewhere / ".manifest.json.tmp").write_text("x")
    root = tmp_path / "out"
    stages = root / CACHE_DIR
    stages.mkdir(parents=True)
    (stages / "quantize").symlink_to(elsewhere)  # a stage folder that is a link: not entered
    (stages / "report").mkdir()
    (stages / "report" / ".def-2.partial").symlink_to(elsewhere / ".abc-1.partial")
    (root / "art").symlink_to(elsewhere)  # an "artifact" that is a link: not entered

    removed = sweep_output(root)

    assert removed == [stages / "report" / ".def-2.partial"]  # the link itself
    assert not (stages / "report" / ".def-2.partial").is_symlink()
    assert tree(elsewhere) == {".abc-1.partial", ".abc-1.partial/keep", ".manifest.json.tmp"}


# --- every stage's temporaries ----------------------------------------------------------------


def killed_inside(code: str, cwd: Path) -> None:
    """Run `code` in a fresh interpreter that SIGKILLs itself where the code says `die()`."""
    script = "import os, signal\ndef die():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script + textwrap.dedent(code)], cwd=cwd, env=env)
    assert proc.returncode == -signal.SIGKILL


def test_the_sweep_removes_what_killed_stages_conversions_and_packaging_left(
    tmp_path: Path,
) -> None:
    root = tmp_path / "out"
    killed_inside(
        """
        from pathlib import Path
        from kiln.compiler.stages import StageCache
        root = Path("out")
        cache = StageCache(root / ".kiln-cache")
        cache.run("source", "k" * 64, lambda out: {})  # a finished stage: kept
        def half_written(out):
            (out / "weights").write_bytes(b"0" * 1024)
            die()
        cache.run("quantize", "q" * 64, half_written)
        """,
        tmp_path,
    )
    killed_inside(
        """
        from pathlib import Path
        from kiln.runtime.formats import artifact
        from kiln.runtime.formats.artifact import Manifest
        with artifact.assemble(Path("out"), Manifest(name="automap")) as staging:
            (staging.dir / "model.safetensors").write_bytes(b"0" * 1024)
            die()
        """,
        tmp_path,
    )
    killed_inside(
        """
        from pathlib import Path
        from kiln.compiler.compile import PackageAhead
        (PackageAhead(Path("out"), "both").folder() / "model.safetensors").write_bytes(b"0")
        die()
        """,
        tmp_path,
    )
    published = root / "automap-0123456789ab"
    published.mkdir()
    (published / "manifest.json").write_text("{}")
    (published / ".manifest.json.tmp").write_text("{")  # killed while rewriting its manifest
    assert any(p.name.endswith(".partial") for p in (root / CACHE_DIR / "quantize").iterdir())
    assert any(p.name.startswith(".automap-") for p in root.iterdir())
    assert any(p.name.startswith(".pytorch-hf-") for p in root.iterdir())

    removed = sweep_output(root)

    assert len(removed) == 4
    assert tree(root) == {
        CACHE_DIR,
        f"{CACHE_DIR}/source",
        f"{CACHE_DIR}/source/{'k' * 24}",
        f"{CACHE_DIR}/source/{'k' * 24}/stage.json",
        f"{CACHE_DIR}/quantize",
        "automap-0123456789ab",
        "automap-0123456789ab/manifest.json",
    }


def test_the_user_cache_is_swept_unless_a_live_run_holds_it(tmp_path: Path) -> None:
    home = tmp_path / "kiln"
    converting = home / "sources" / ".hf_dir-0123456789abcdef.x1y2.tmp"
    (converting / "model").mkdir(parents=True)
    (converting / "model" / "model.safetensors").write_bytes(b"0" * 1024)
    (home / ".file-digests.json.4242.tmp").write_text("{")
    (home / "sources" / "hf_dir-0123456789abcdef").mkdir()  # a finished entry: kept
    (home / "file-digests.json").write_text("{}")

    with holding(home / "sources"):  # another run is converting a source right now
        sweep_user_cache(home)
        assert converting.is_dir()
    assert not (home / ".file-digests.json.4242.tmp").exists()

    sweep_user_cache(home)
    assert tree(home) == {"sources", "sources/hf_dir-0123456789abcdef", "file-digests.json"}


def test_a_manifest_being_rewritten_is_left_alone_and_swept_once_its_writer_is_gone(
    tmp_path: Path,
) -> None:
    from kiln.runtime.formats import artifact
    from tests.gates.conftest import build_artifact

    root = tmp_path / "out"
    published = build_artifact(root)
    live = published / ".manifest.json.4242.0123456789ab.tmp"
    live.write_text("{")
    # A gate step records its verdict after the output lock is released: a compile that
    # starts meanwhile sweeps the output directory while that rewrite is under way.
    with artifact.manifest_lock(published):
        assert sweep_output(root) == []
        assert live.is_file()
    assert sweep_output(root) == [live]
    assert artifact.verify(published) == []
