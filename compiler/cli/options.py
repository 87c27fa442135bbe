"""Options several `kiln` commands share, declared once."""

from __future__ import annotations

import click

REGISTRY_OPTION = click.option(
    "--registry",
    "registry_spec",
    envvar="KILN_REGISTRY",
    help="Registry file or sqlite:/// URL (default: $KILN_REGISTRY, "
    "else ~/.local/share/kiln/registry.db).",
)

# Used by every command that reads an artifact it is about to serve, gate, promote or
# roll back to (runtime/formats/artifact/verified.py says what each mode trusts).
VERIFY_OPTION = click.option(
    "--verify",
    type=click.Choice(["fast", "full"]),
    default="fast",
    show_default=True,
    help="Check artifacts against their manifests first: `fast` trusts an earlier full check "
    "while no file changed since, `full` re-hashes every file.",
)

JSON_OPTION = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on stdout."
)
