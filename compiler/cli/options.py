"""What several `kiln` commands share, declared once: options, old spellings, the command
class that reads a bare `--verify`, and the check that an artifact argument names a path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.artifact.verified import MODES

REGISTRY_OPTION = click.option(
    "--registry",
    "registry_spec",
    envvar="KILN_REGISTRY",
    help="Registry file or sqlite:/// URL (default: $KILN_REGISTRY, "
    "else ~/.local/share/kiln/registry.db).",
)


def verify_option(default: str | None = "fast") -> Callable[[Any], Any]:
    """`--verify [fast|full]`; given alone it means `full` (KilnCommand reads it so).
    runtime/formats/artifact/verified.py says what each mode trusts."""
    unset = f"default: {default or 'no check'}"
    return click.option(
        "--verify",
        type=click.Choice(MODES),
        default=default,
        help="Check the artifact against its manifest first: `fast` trusts an earlier full "
        f"check while no file changed since, `full` (or `--verify` alone) re-hashes every "
        f"file ({unset}).",
    )


# Used by every command that reads an artifact it is about to serve, gate, promote or
# roll back to.
VERIFY_OPTION = verify_option()

JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on stdout."
)


class KilnCommand(click.Command):
    """A `kiln` command whose `--verify` may stand alone, before an argument too
    (`kiln inspect --verify DIR`): click would take DIR as the mode, so a bare `--verify`
    is read as `--verify=full` before click parses the line."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, bare_verify(args))


def bare_verify(args: list[str]) -> list[str]:
    """`args` with each `--verify` not followed by a mode spelled `--verify=full`."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--":
            break
        if arg == "--verify" and (i + 1 == len(out) or out[i + 1] not in MODES):
            out[i] = "--verify=full"
    return out


def old_spellings(renamed: dict[str, str]) -> dict[str, Any]:
    """Context settings under which each old option name in `renamed` (without its dashes)
    still works for its new one, unlisted: click passes every option name through this."""

    def normalize(name: str) -> str:
        return renamed.get(name, name)

    return {"token_normalize_func": normalize}


def artifact_dir(path: Path) -> Path:
    """`path`, where it is an artifact directory; UsageError (exit 2, as for any path that
    names no artifact, as serve and gate say) otherwise. A damaged artifact is for the
    artifact reader to refuse (exit 3)."""
    if not (path / "manifest.json").exists():
        what = "not a kiln artifact (no manifest.json)" if path.exists() else "no such directory"
        raise UsageError(
            f"{path}: {what}; pass an artifact directory, the one `kiln compile` printed as "
            "`artifact`"
        )
    return path
