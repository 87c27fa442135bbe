"""The `kiln` command line.

Exit codes: 0 ok, 1 verdict failure, 2 usage or recipe error, 3 runtime failure. Expected
mistakes print their message without a traceback; `--json` prints one JSON object on stdout
and sends progress to stderr.
"""

from __future__ import annotations

import click

from kiln.compiler.cli import bench as bench_command
from kiln.compiler.cli import compile as compile_commands
from kiln.compiler.cli import draft as draft_command
from kiln.compiler.cli import gate as gate_commands
from kiln.compiler.cli import search as search_command
from kiln.compiler.cli import serve as serve_command
from kiln.compiler.cli.exits import debug_option


class KilnGroup(click.Group):
    """The `kiln` group. `--debug` is its option (`kiln --debug compile R`); every command it
    mounts also accepts it after the command's name (`kiln compile R --debug`), unlisted."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        _accept_debug(cmd)
        super().add_command(cmd, name)


def _accept_debug(command: click.Command) -> None:
    if not any(param.name == "debug" for param in command.params):
        command.params.append(debug_option(hidden=True))
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _accept_debug(sub)


@click.group(
    cls=KilnGroup,
    params=[debug_option()],
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="kiln")
def main() -> None:
    """kiln: compile, gate and serve quantised LLMs for NVIDIA GPUs.

    `--debug` goes before the command (`kiln --debug compile R`) or after its name. Every
    command takes `--json` (one JSON object on stdout) and `--help`; exit codes: 0 ok, 1
    verdict failure, 2 usage or recipe error, 3 runtime failure.

    \b
    Example:
      kiln validate recipes/demo.yaml
      kiln compile recipes/demo.yaml
      kiln serve artifacts/<name>-<digest>
    """


# Every command, imported statically: `kiln validate|plan|compile|inspect` (cli/compile.py),
# `gate|promote|rollback|registry` (cli/gate.py), `search`, `serve`, `bench` and `draft`.
for _command in (
    compile_commands.validate,
    compile_commands.plan,
    compile_commands.compile_cmd,
    compile_commands.inspect,
    gate_commands.gate,
    gate_commands.promote,
    gate_commands.rollback,
    gate_commands.registry,
    search_command.search,
    serve_command.serve,
    bench_command.bench,
    draft_command.draft_command,
):
    main.add_command(_command)


if __name__ == "__main__":
    main()
