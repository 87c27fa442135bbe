"""The `kiln` command line.

Exit codes: 0 ok, 1 verdict failure, 2 usage or recipe error, 3 runtime failure. Expected
mistakes print their message without a traceback; `--json` prints one JSON object on stdout
and sends progress to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from runtime.exits import handle_errors

F = TypeVar("F", bound=Callable[..., Any])
err = Console(stderr=True, highlight=False)
out = Console(highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kiln")
def main() -> None:
    """kiln: compile, gate and serve quantised LLMs for NVIDIA GPUs."""


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--debug", is_flag=True, hidden=True)
@handle_errors
def validate(recipe: Path, as_json: bool, debug: bool) -> None:
    """Check RECIPE completely (schema, model, scheme, data, targets, memory) without running it."""
    from compiler.preflight import validate_recipe
    from runtime.errors import RecipeError

    try:
        loaded = validate_recipe(recipe)
    except RecipeError as exc:
        if as_json:
            click.echo(json.dumps({"valid": False, "problems": exc.problems}))
            sys.exit(exc.exit_code)
        raise
    if as_json:
        click.echo(json.dumps({"valid": True, "recipe": loaded.resolved()}))
    else:
        out.print(
            f"{recipe}: ok ({loaded.name}: {loaded.quant_spec().method}, "
            f"backend {loaded.quant_spec().backend})"
        )


@main.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--target", "only", multiple=True, help="Plan only these targets (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--debug", is_flag=True, hidden=True)
@handle_errors
def plan(recipe: Path, only: tuple[str, ...], as_json: bool, debug: bool) -> None:
    """Plan GPU memory, KV capacity, tensor parallelism and cost for RECIPE's targets."""
    from compiler.planner import format_plan
    from compiler.preflight import validate_recipe_plans
    from runtime.errors import UsageError

    plans = validate_recipe_plans(recipe)
    unknown = sorted(set(only) - set(plans))
    if unknown:
        raise UsageError(
            f"--target {', '.join(unknown)}: not in the recipe's targets "
            f"({', '.join(plans) or 'none'}) — add it to `targets:`"
        )
    chosen = {name: p for name, p in plans.items() if not only or name in only}
    if not chosen:
        raise UsageError(
            f"{recipe}: the recipe has no `targets:` to plan — add GPU names, "
            "e.g. targets: [h100-sxm]"
        )
    if as_json:
        click.echo(json.dumps({name: p.to_dict() for name, p in chosen.items()}))
        return
    for name, target_plan in chosen.items():
        out.print(f"[bold]{name}[/]")
        out.print(format_plan(target_plan), markup=False)
        out.print()


@main.command(name="compile")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    help="Output root (default: the recipe's `output`).",
)
@click.option("--force", is_flag=True, help="Recompute every stage even when cached.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--debug", is_flag=True, help="Show tracebacks of unexpected failures.")
@handle_errors
def compile_cmd(recipe: Path, output: Path | None, force: bool, as_json: bool, debug: bool) -> None:
    """Compile RECIPE into a content-addressed artifact."""
    from compiler.compile import compile_recipe

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        result = compile_recipe(
            recipe,
            output=output,
            force=force,
            progress=lambda text: bar.update(task, description=text),
        )
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    table = Table(title=f"kiln compile {recipe}", title_justify="left")
    for column in ("stage", "status", "seconds"):
        table.add_column(column)
    for stage in result.stages:
        table.add_row(stage.name, stage.status, f"{stage.seconds:.1f}")
    err.print(table)
    if result.up_to_date:
        err.print("up to date: nothing changed since the last compile")
    out.print(f"artifact: {result.artifact}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--verify", is_flag=True, help="Re-hash every file against the manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--debug", is_flag=True, hidden=True)
@handle_errors
def inspect(artifact_dir: Path, verify: bool, as_json: bool, debug: bool) -> None:
    """Show an artifact's manifest, sizes and scheme; --verify re-checks every digest."""
    from compiler.inspect import describe
    from runtime import artifact
    from runtime.errors import ArtifactError

    manifest = artifact.load_manifest(artifact_dir)
    problems = artifact.verify(artifact_dir) if verify else []
    if as_json:
        click.echo(
            json.dumps(
                {**manifest.to_dict(), "verified": verify and not problems, "problems": problems}
            )
        )
    else:
        describe(manifest, artifact_dir, out)
        if verify:
            out.print("verify: all digests match" if not problems else "verify: FAILED")
    if problems:
        raise ArtifactError(
            f"{artifact_dir}: {len(problems)} file(s) do not match the manifest:\n  "
            + "\n  ".join(problems)
        )


def _register_gate_commands() -> None:
    """`kiln gate`, `promote`, `rollback` and `registry` live with the gate package."""
    from gates.cli import COMMANDS

    for command in COMMANDS:
        main.add_command(command)


_register_gate_commands()


if __name__ == "__main__":
    main()
