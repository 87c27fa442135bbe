"""A full disk is said to be one (exit 3), whichever library's exception carries it: an OSError
with ENOSPC, safetensors' SafetensorError, torch's writers, SQLite's "database or disk is full",
or any of them as the cause of kiln's own error. A file past `ulimit -f` is no full disk.

The full disk is real: a 128 KiB tmpfs mounted in a private user and mount namespace
(`unshare -rm`, no root needed; nothing outside the process sees it).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from kiln.compiler.cli.exits import handle_errors
from kiln.runtime.base.errors import StageFailure, UsageError

REPO = Path(__file__).resolve().parents[2]
FULL = "no space left on the device"

# Each writer's exception on the disk in $TARGET, and what kiln makes of it, as JSON lines.
WRITERS = """
import json, os, sqlite3, sys
import torch
from safetensors.torch import save_file
from kiln.runtime.base.errors import disk_full

big = {"w": torch.zeros(200_000)}  # 800 KB: more than the disk holds

def plain(path):
    with open(path, "wb") as file:
        file.write(b"x" * 1_000_000)

def table(path):
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
        db.executemany("INSERT INTO t VALUES (?)", [("x" * 1000,)] * 2000)

writers = {
    "open": plain,
    "safetensors": lambda path: save_file(big, path),
    "torch.save": lambda path: torch.save(big, path),
    "torch.save-legacy": lambda path: torch.save(big, path, _use_new_zipfile_serialization=False),
    "torch.save-file": lambda path: torch.save(big, open(path, "wb")),
    "sqlite": table,
}
for name, write in writers.items():
    path = os.path.join(os.environ["TARGET"], name)
    try:
        write(path)
        print(json.dumps([name, None, None]))
    except Exception as exc:
        print(json.dumps([name, f"{type(exc).__name__}: {exc}", disk_full(exc)]))
    if os.path.exists(path):  # safetensors removes what it could not finish
        os.remove(path)
"""


@cache
def can_mount_a_tmpfs() -> bool:
    """Whether this kernel lets an unprivileged user namespace mount a tmpfs."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as probe:
        done = subprocess.run(
            ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=4k", "kiln-probe", probe],
            capture_output=True,
        )
    return done.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    not can_mount_a_tmpfs(), reason="needs user namespaces to mount a small tmpfs (unshare -rm)"
)


def on_full_disk(
    target: Path, *command: str, size: str = "128k"
) -> subprocess.CompletedProcess[str]:
    """Run `command` with a tmpfs of `size` (128 KiB, or bytes with a k/m/g suffix or none)
    mounted on `target` (an empty directory) for it."""
    mount = 'mount -t tmpfs -o size="$SIZE" kiln-full "$TARGET" && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", mount, "sh", *command],
        env={**os.environ, "TARGET": str(target), "SIZE": size, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def writers_on(target: Path, limit_bytes: int | None = None) -> dict[str, tuple[str, str | None]]:
    """{writer: (its exception, kiln's message for it)}: on a full disk, or with a file size
    limit (`ulimit -f`) on an ordinary one."""
    if limit_bytes is None:
        done = on_full_disk(target, sys.executable, "-c", WRITERS)
    else:

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

        env = {**os.environ, "TARGET": str(target), "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-c", WRITERS], env=env, preexec_fn=limit,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    for name, raised, _ in rows:
        assert raised is not None, f"{name} wrote past the limit without an error"
    return {name: (raised, message) for name, raised, message in rows}


@pytest.fixture(scope="module")
def on_a_full_disk(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return writers_on(tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def past_a_size_limit(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return writers_on(tmp_path_factory.mktemp("limited"), limit_bytes=64 * 1024)


@needs_tmpfs
@pytest.mark.parametrize(
    ("writer", "raised"),
    [
        ("open", "OSError: [Errno 28] No space left on device"),
        ("safetensors", "SafetensorError: Error while serializing: I/O error: No space left"),
        ("torch.save-legacy", "RuntimeError: write(): fd"),
        ("torch.save-file", "RuntimeError: [enforce fail at inline_container"),  # OSError inside
        ("sqlite", "OperationalError: database or disk is full"),
    ],
)
def test_a_full_disk_is_said_so_whichever_library_wrote(
    on_a_full_disk: dict[str, Any], writer: str, raised: str
) -> None:
    exception, message = on_a_full_disk[writer]
    assert exception.startswith(raised)
    assert message is not None and message.startswith(FULL), message
    assert "free some space" in message


@needs_tmpfs
def test_torch_s_writer_failing_for_no_stated_reason_is_likely_a_full_disk(
    on_a_full_disk: dict[str, Any],
) -> None:
    """torch.save to a path: its zip writer reports a short write and no errno."""
    exception, message = on_a_full_disk["torch.save"]
    assert "unexpected pos" in exception
    assert message.startswith("a file write stopped part-way (RuntimeError: [enforce fail")
    assert "most likely the disk is full" in message and "ulimit -f" not in message


@pytest.mark.parametrize("writer", ["open", "safetensors", "torch.save-legacy", "torch.save-file"])
def test_a_file_size_limit_is_not_a_full_disk(past_a_size_limit: dict[str, Any], writer: str):
    exception, message = past_a_size_limit[writer]
    assert "File too large" in exception or "unexpected pos" in exception
    assert message is None


def test_torch_s_reasonless_failure_under_a_size_limit_names_the_limit(
    past_a_size_limit: dict[str, Any],
) -> None:
    _, message = past_a_size_limit["torch.save"]
    assert "size limit (65536 bytes, ulimit -f)" in message


def _failing(error: Exception) -> click.Command:
    @click.command()
    @handle_errors
    def command() -> None:
        raise error

    return command


def _full(where: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)


def test_kiln_s_own_error_caused_by_a_full_disk_says_the_disk_is_full() -> None:
    try:
        raise StageFailure("stage quantize failed: OSError") from _full("/out/model.bin")
    except StageFailure as exc:
        result = CliRunner().invoke(_failing(exc), [])
    assert result.exit_code == 3
    assert f"error: {FULL} writing /out/model.bin; free some space" in result.stderr


def test_kiln_s_error_raised_from_none_keeps_its_own_message() -> None:
    """`raise ... from None` says the cause is not the point: the chain ends there."""
    try:
        try:
            raise _full("/registry.db")
        except OSError:
            raise UsageError("registry /registry.db: cannot be opened") from None
    except UsageError as exc:
        result = CliRunner().invoke(_failing(exc), [])
    assert result.exit_code == 2 and "cannot be opened" in result.stderr
    assert FULL not in result.stderr


@needs_tmpfs
def test_a_compile_onto_a_full_disk_exits_3_saying_so(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: full-disk\nmodel:\n  source: {tiny_llama}\nquantization:\n  method: gptq\n"
        "  group_size: 64\ncalibration:\n  dataset: builtin:licenses\n  num_samples: 4\n"
    )
    out = tmp_path / "full"
    out.mkdir()
    # Past the check of free space before the stages (tests/compiler/test_disk_budget.py), as
    # if its estimate were wrong: a write that fails mid-way says why.
    compile_ = ["env", "KILN_NO_DISK_CHECK=1", sys.executable, "-m", "kiln.compiler.cli",
                "compile", str(recipe), "--output"]  # fmt: skip
    done = on_full_disk(out, *compile_, f"{out}/artifacts")
    assert done.returncode == 3, done.stderr
    assert f"error: {FULL}" in done.stderr and "internal error" not in done.stderr


# What each small-file writer leaves on a full disk: its error, then the directory's names.
SMALL_WRITERS = """
import json, os, sys
from pathlib import Path
from kiln.runtime.base.atomic import replace_text
from kiln.gates.measure.eval_cache import EvaluationCache
from kiln.runtime.formats.artifact.verified import _write_stamp
from kiln.gates.releases import Registry

target = Path(os.environ["TARGET"])
big = "x" * 1_000_000
writers = {
    "replace_text": lambda: replace_text(target / "state.json", big),
    "eval cache": lambda: EvaluationCache(target / "cache").put("k", {"text": big}),
    "verify stamp": lambda: _write_stamp(target / "stamp.json", "d", {"f": [big]}),
    "registry": lambda: Registry(target / "registry.db"),
}
for name, write in writers.items():
    try:
        write()
        raised = None
    except OSError as exc:
        raised = exc.strerror
    except Exception as exc:  # SQLite's own
        raised = str(exc)
    left = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.name != "filler")
    print(json.dumps([name, raised, left]))
    if name == "verify stamp":  # the registry's first pages are small: fill the disk first
        try:
            with open(target / "filler", "ab") as file:
                file.write(b"x" * 10_000_000)
        except OSError:
            pass
"""


@needs_tmpfs
def test_a_small_file_that_does_not_fit_leaves_no_temporary(tmp_path: Path) -> None:
    """A state, an eval-cache entry or a verification stamp that the disk cannot hold is not
    written, and the temporary it was written through is gone too (a full disk stays no
    fuller than it was)."""
    done = on_full_disk(tmp_path, sys.executable, "-c", SMALL_WRITERS)
    assert done.returncode == 0, done.stderr
    rows = {
        name: (raised, left) for name, raised, left in map(json.loads, done.stdout.split("\n")[:-1])
    }
    assert rows["replace_text"] == ("No space left on device", [])
    assert rows["eval cache"] == ("No space left on device", ["cache"])
    assert rows["verify stamp"] == (None, ["cache"])  # a stamp is only a cache: no error
    assert rows["registry"] == ("database or disk is full", ["cache"])  # no empty registry.db
