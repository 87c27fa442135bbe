"""`python -m kiln.compiler.cli ...` runs the `kiln` command."""

from kiln.compiler.cli.console import run

run()
