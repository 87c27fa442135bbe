"""A registry file that is not one, and channel names that are not names, are refused
naming the input (exit 2), never as an internal error; a write waits for another writer a
bounded time and says so."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.gates.releases import Registry, check_channel
from kiln.runtime.base.errors import KilnError, UsageError


def kiln(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    "content", [b"not a database at all\n", b"SQLite format 3\x00" + b"\xff" * 200]
)
def test_a_file_that_is_not_a_registry_exits_2_naming_it(tmp_path: Path, content: bytes):
    bad = tmp_path / "registry.db"
    bad.write_bytes(content)
    code, out = kiln("registry", "ls", "--registry", str(bad))
    assert code == 2 and str(bad) in out and "not a kiln registry" in out
    assert "internal error" not in out


def test_an_empty_sqlite_url_exits_2(tmp_path: Path) -> None:
    code, out = kiln("registry", "ls", "--registry", "sqlite:///")
    assert code == 2 and "names no file" in out


def test_a_directory_as_registry_exits_2(tmp_path: Path) -> None:
    code, out = kiln("registry", "ls", "--registry", str(tmp_path))
    assert code == 2 and "a directory" in out


@pytest.mark.parametrize("name", ["", "../../..", "prod\nstaging", "-x", "a" * 65, "pro d"])
def test_a_channel_name_that_is_not_one_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UsageError, match="a channel name is"):
        check_channel(name)
    with Registry(tmp_path / "r.db") as registry, pytest.raises(UsageError):
        registry.configure_channel(name)


def test_channel_names_of_the_usual_kinds_are_taken(tmp_path: Path) -> None:
    for name in ("prod", "staging-eu", "canary.1", "A_b"):
        assert check_channel(name) == name


def test_a_write_waits_a_bounded_time_for_another_writer_naming_the_registry(tmp_path: Path):
    path = tmp_path / "r.db"
    holder, waiter = Registry(path), Registry(path, lock_wait_s=0.2)
    with holder, waiter, holder._write():  # another process mid-promotion
        started = time.monotonic()
        with pytest.raises(KilnError, match=r"r\.db: another process has held its write"):
            waiter.configure_channel("prod", baseline_rule="current")
        assert time.monotonic() - started < 30
    with Registry(path) as registry:  # nothing was changed, and the registry still works
        assert registry.channel("prod") is None
