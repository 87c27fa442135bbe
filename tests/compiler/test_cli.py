"""The `kiln` command group: `--debug` is declared once and reaches every command."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.main import main


@click.command("explode")
@click.option("--times", default=1)
@handle_errors
def explode(times: int) -> None:
    """A command that fails the way a bug would."""
    raise RuntimeError(f"boom x{times}")


@pytest.fixture
def kiln() -> Iterator[click.Group]:
    """The real `kiln` group with one failing command mounted for the test."""
    main.add_command(explode)
    yield main
    main.commands.pop("explode")


def test_an_unexpected_failure_says_how_to_see_its_traceback(kiln: click.Group) -> None:
    result = CliRunner().invoke(kiln, ["explode"])
    assert result.exit_code == 3
    assert "internal error: RuntimeError: boom x1" in result.stderr
    assert "kiln --debug" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [["--debug", "explode", "--times", "2"], ["explode", "--debug", "--times", "2"]],
    ids=["before-the-command", "after-its-name"],
)
def test_debug_prints_the_traceback(kiln: click.Group, args: list[str]) -> None:
    result = CliRunner().invoke(kiln, args)
    assert result.exit_code == 3
    assert "Traceback (most recent call last)" in result.stderr
    assert 'raise RuntimeError(f"boom x{times}")' in result.stderr  # the failing line


def test_nested_commands_take_debug_after_their_name(kiln: click.Group, tmp_path: Path) -> None:
    registry = str(tmp_path / "registry.db")
    result = CliRunner().invoke(kiln, ["registry", "ls", "--registry", registry, "--debug"])
    assert result.exit_code == 0 and "channels: none" in result.output


def test_debug_is_listed_once_on_the_group(kiln: click.Group) -> None:
    group_help = CliRunner().invoke(kiln, ["--help"]).output
    assert "--debug" in group_help
    for name in ("compile", "gate", "serve", "bench", "draft", "validate"):
        assert "--debug" not in CliRunner().invoke(kiln, [name, "--help"]).output
    assert "--debug" not in CliRunner().invoke(kiln, ["registry", "ls", "--help"]).output
