"""A published artifact's manifest is rewritten atomically and by one writer at a time:
concurrent writers lose no update and never show half a manifest, and a writer that cannot
get the lock within its wait fails naming the artifact and leaves the manifest as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats import artifact
from tests.gates.conftest import build_artifact

REPO = Path(__file__).resolve().parents[2]

# Each writer waits for the start file, so all of them write at once.
WRITER = """
import os, sys, time
from pathlib import Path
from kiln.runtime.formats import artifact

root, go, tag, count, mode = sys.argv[1:]
root, go = Path(root), Path(go)
while not go.exists():
    time.sleep(0.001)
for i in range(int(count)):
    if mode == "update":
        note = f"{tag}-{i}"
        artifact.update_manifest(root, lambda m: m.extra.setdefault("notes", []).append(note))
    else:
        artifact.write_manifest(root, artifact.load_manifest(root))
"""


def writers(root: Path, tmp: Path, mode: str, count: int, n: int = 4) -> list[str]:
    """Run `n` writer processes at once; read the manifest while they write. Returns their
    stderr for each that failed."""
    go = tmp / "go"
    # kiln from this checkout first, then whatever the caller's path holds (its packages)
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(go), f"w{k}", str(count), mode],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(n)
    ]
    time.sleep(0.5)  # let them start; the test does not depend on how long they take
    go.touch()
    while any(p.poll() is None for p in procs):
        artifact.load_manifest(root)  # a reader never sees half a manifest (it would raise)
    return [p.stderr.read() for p in procs if p.wait() != 0 and p.stderr is not None]


def temporaries(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(artifact.MANIFEST_TEMPORARIES))


@pytest.fixture
def published(tmp_path: Path) -> Path:
    return build_artifact(tmp_path / "arts")


def test_concurrent_manifest_writes_never_share_a_temporary(
    published: Path, tmp_path: Path
) -> None:
    failed = writers(published, tmp_path, "write", count=50)
    assert failed == []
    assert temporaries(published) == []
    assert artifact.verify(published) == []


def test_concurrent_read_modify_writes_lose_no_update(published: Path, tmp_path: Path) -> None:
    failed = writers(published, tmp_path, "update", count=25)
    assert failed == []
    notes = artifact.load_manifest(published).extra["notes"]
    assert sorted(notes) == sorted(f"w{k}-{i}" for k in range(4) for i in range(25))
    assert temporaries(published) == []
    assert artifact.verify(published) == []


def test_a_writer_that_cannot_get_the_lock_fails_naming_the_artifact(published: Path) -> None:
    before = (published / artifact.MANIFEST).read_bytes()
    # Another writer, stuck, holds the lock.
    with artifact.manifest_lock(published), pytest.raises(ArtifactError) as caught:
        artifact.update_manifest(published, lambda m: m.extra.update(x=1), wait_s=0.1)
    message = caught.value.message
    assert str(published) in message and "manifest lock" in message and "retry" in message
    assert (published / artifact.MANIFEST).read_bytes() == before
    assert temporaries(published) == []


def test_a_writer_waits_for_the_lock_and_then_writes_on_the_latest_manifest(
    published: Path,
) -> None:
    held, release = threading.Event(), threading.Event()

    def other_writer() -> None:
        with artifact.manifest_lock(published):
            held.set()
            release.wait()
            manifest = artifact.load_manifest(published)
            manifest.extra["first"] = True
            artifact.write_manifest(published, manifest)

    thread = threading.Thread(target=other_writer)
    thread.start()
    held.wait()
    threading.Timer(0.2, release.set).start()
    artifact.update_manifest(published, lambda m: m.extra.update(second=True))
    thread.join()
    assert artifact.load_manifest(published).extra == {"first": True, "second": True}
