"""`kiln validate`, `kiln plan`, `kiln compile` and `kiln inspect`: the recipe's commands.

Exit codes: 0 ok, 1 verdict failure, 2 usage or recipe error, 3 runtime failure. `--json`
prints one JSON object on stdout and sends progress to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from kiln.compiler.cli.consoles import console
from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import KilnCommand, artifact_dir, verify_option

if TYPE_CHECKING:
    from kiln.compiler.recipe.recipe import Recipe

OUTPUT_HELP = "Output root (default: the recipe's `output`)."


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), help=OUTPUT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def validate(recipe: Path, output: Path | None, as_json: bool) -> None:
    """Check RECIPE completely (schema, model, scheme, data, targets, memory, disk) without
    running it; every problem found is reported at once.

    \b
    Example:
      kiln validate recipes/demo.yaml
      kiln validate recipes/demo.yaml --json | jq .problems
    """
    from kiln.compiler.cli.describe import disk_summary
    from kiln.compiler.preflight import run_preflight
    from kiln.compiler.recipe.errors import RecipeError
    from kiln.compiler.recipe.recipe import load_recipe

    try:
        plan = run_preflight(load_recipe(recipe), output=output)
    except RecipeError as exc:
        if as_json:
            click.echo(json.dumps({"valid": False, "problems": exc.problems}))
            sys.exit(exc.exit_code)
        raise
    disk = plan.disk
    assert disk is not None  # run_preflight estimates it when it checks memory
    if as_json:
        click.echo(json.dumps({"valid": True, "recipe": plan.resolved, "disk": disk.to_dict()}))
    else:
        spec = plan.recipe.quant_spec()  # as the recipe asked, whatever an import brings
        console().print(f"{recipe}: ok ({plan.recipe.name}: {spec.method}, backend {spec.backend})")
        click.echo(disk_summary(disk))


@click.command()
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--target", "only", multiple=True, help="Plan only these targets (repeatable).")
@click.option("--output", type=click.Path(path_type=Path), help=OUTPUT_HELP)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object on stdout: each target's plan by name, and `disk`.",
)
@handle_errors
def plan(recipe: Path, only: tuple[str, ...], output: Path | None, as_json: bool) -> None:
    """Plan GPU memory, KV capacity, tensor parallelism and cost for RECIPE's targets, and the
    disk its compile needs.

    \b
    Example:
      kiln plan recipes/demo.yaml --target h100-sxm
    """
    from kiln.compiler.cli.describe import format_disk, format_plan
    from kiln.compiler.preflight import disk_estimate, run_preflight
    from kiln.compiler.recipe.recipe import load_recipe
    from kiln.runtime.base.errors import UsageError

    parsed = load_recipe(recipe)
    pre = run_preflight(parsed, check_memory=False)
    plans = pre.plans
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
    disk = disk_estimate(pre, output or parsed.output_dir())
    if as_json:
        targets = {name: p.to_dict() for name, p in chosen.items()}
        click.echo(json.dumps({**targets, "disk": disk.to_dict()}))
        return
    out = console()
    for name, target_plan in chosen.items():
        out.print(f"[bold]{name}[/]")
        out.print(format_plan(target_plan), markup=False)
        out.print()
    out.print("[bold]disk[/] (all targets: one compile)")
    click.echo(format_disk(disk))


@click.command(name="compile")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), help=OUTPUT_HELP)
@click.option("--force", is_flag=True, help="Recompute every stage even when cached.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check the recipe and list each stage with whether it would run or is cached, and "
    "the disk it needs; load no model, run nothing.",
)
@click.option(
    "--promote",
    metavar="CHANNEL",
    help="Promote the artifact to CHANNEL in the registry when its gate passes.",
)
@click.option("--no-gate", is_flag=True, help="Skip the recipe's `gates:` (nothing is promoted).")
@click.option(
    "--registry",
    "registry_spec",
    envvar="KILN_REGISTRY",
    help="Registry file or sqlite:/// URL for gate runs and promotion (default: $KILN_REGISTRY, "
    "else ~/.local/share/kiln/registry.db).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def compile_cmd(
    recipe: Path,
    output: Path | None,
    force: bool,
    dry_run: bool,
    promote: str | None,
    no_gate: bool,
    registry_spec: str | None,
    as_json: bool,
) -> None:
    """Compile RECIPE into a content-addressed artifact, then gate it if the recipe says so.

    Before anything loads, the disk the compile writes (`kiln plan` itemises it) is checked
    against the free space of the output's filesystem; the estimate is an upper bound, and
    KILN_NO_DISK_CHECK=1 skips the check. On a terminal each step shows a bar (per layer
    while quantising and reporting) with the time left; in a log, each step is a timed line.

    \b
    Example:
      kiln compile recipes/demo.yaml --dry-run
      kiln compile recipes/demo.yaml --output /data/artifacts --json > compiled.json
    """
    from kiln.compiler.cli.progress import step_progress
    from kiln.compiler.cli.stdout_guard import stdout_to_stderr
    from kiln.compiler.compile import compile_recipe
    from kiln.compiler.gating import check_gate_options, gate_compiled
    from kiln.compiler.recipe.recipe import load_recipe
    from kiln.compiler.trtllm.deploy import TargetFailure
    from kiln.runtime.base.errors import VerdictFailure

    parsed = load_recipe(recipe)
    check_gate_options(parsed, promote, not no_gate)
    if dry_run:
        _dry_run(parsed, output, force, as_json)
        return
    err = console(stderr=True)
    failure: TargetFailure | None = None
    # With --json, stdout carries exactly one JSON object: library prints go to stderr.
    with stdout_to_stderr(as_json), step_progress(err, _log_line) as progress:
        step = None
        try:
            result = compile_recipe(recipe, output=output, force=force, progress=progress)
        except TargetFailure as exc:
            failure = exc
        if failure is None and not no_gate and parsed.config.gates is not None:
            from kiln.gates.releases import Registry

            with Registry(registry_spec) as registry:
                step = gate_compiled(
                    result, parsed, registry=registry, promote=promote, force=force,
                    progress=progress,
                )  # fmt: skip
    if failure is not None:
        if as_json:
            click.echo(json.dumps({"artifact": None, "targets": failure.targets}))
        raise failure
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "gate": step.to_dict() if step else None}))
    else:
        table = Table(title=f"kiln compile {recipe}", title_justify="left")
        for column in ("stage", "status", "seconds"):
            table.add_column(column)
        for stage in result.stages:
            table.add_row(stage.name, stage.status, f"{stage.seconds:.1f}")
        if step is not None:
            status = ("passed" if step.passed else "FAILED") + (" (cached)" if step.cached else "")
            table.add_row("gate", status, f"{step.verdict.get('seconds') or 0:.1f}")
        err.print(table)
        if result.up_to_date:
            err.print("up to date: nothing changed since the last compile")
        if step is not None:
            from kiln.gates.report.markdown import MARKDOWN

            click.echo((step.reports_dir / MARKDOWN).read_text(), err=True)  # unwrapped
            err.print(f"gate reports: {step.reports_dir}")
        out = console()
        out.print(f"artifact: {result.artifact}")
        if step is not None and step.promotion is not None:
            previous = (step.promotion["previous_digest"] or "nothing")[:12]
            out.print(f"promoted: {promote} -> {result.digest[:12]} (was {previous})")
    if step is not None and not step.passed:
        failed = ", ".join(step.failed_checks)
        kept = f"; {promote} was not promoted" if promote else ""
        raise VerdictFailure(
            f"{result.artifact}: gate failed against {step.baseline.name} ({failed}){kept}; "
            f"see {step.reports_dir}"
        )


def _log_line(line: str) -> None:
    click.echo(line, err=True)


def _dry_run(recipe: Recipe, output: Path | None, force: bool, as_json: bool) -> None:
    """`kiln compile --dry-run`: the preflight a compile runs, and what each stage would do."""
    from kiln.compiler.cli.describe import disk_summary, format_stage_plan, stage_plan
    from kiln.compiler.preflight import run_preflight

    pre = run_preflight(recipe, output=output, force=force)
    disk = pre.disk
    assert disk is not None  # run_preflight estimates it when it checks memory
    spec = pre.speculative
    draft = spec is not None and spec.method == "draft"
    auto_k = draft and spec is not None and spec.max_draft_len is None
    stages = stage_plan(disk, draft, auto_k, force)
    if as_json:
        click.echo(json.dumps({"dry_run": True, "recipe": str(recipe.path), "stages": stages,
                               "disk": disk.to_dict()}))  # fmt: skip
        return
    runs = sum(row["status"] != "cached" for row in stages)
    click.echo(f"kiln compile {recipe.path} --dry-run: {runs} of {len(stages)} stage(s) to run, "
               "nothing run now")  # fmt: skip
    click.echo(format_stage_plan(stages))
    click.echo(disk_summary(disk))


@click.command(cls=KilnCommand)
@click.argument("artifact_path", metavar="ARTIFACT_DIR", type=click.Path(path_type=Path))
@verify_option(default=None)
@click.option(
    "--record-engines",
    is_flag=True,
    help="Record the digests of engines built into the artifact after publication "
    "(engines/<target>/engine/), so that --verify and every later check verify them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@handle_errors
def inspect(artifact_path: Path, verify: str | None, record_engines: bool, as_json: bool) -> None:
    """Show an artifact's manifest, sizes and scheme; --verify checks every file against it.

    \b
    Example:
      kiln inspect artifacts/smollm2-135m-gptq-w4a16-0c7038bf902e --verify
    """
    from kiln.compiler.cli.describe import describe
    from kiln.runtime.base.errors import ArtifactError
    from kiln.runtime.formats import artifact

    artifact_dir(artifact_path)
    if record_engines:
        recorded = artifact.record_engines(artifact_path).engines
        console(stderr=True).print(
            f"recorded {len(recorded)} engine file(s) of {artifact_path} in its manifest"
        )
    manifest = artifact.load_manifest(artifact_path)
    problems = _verify_problems(artifact_path, verify) if verify else []
    if as_json:
        verified = verify is not None and not problems
        click.echo(json.dumps({**manifest.to_dict(), "verified": verified, "verify": verify,
                               "problems": problems}))  # fmt: skip
    else:
        out = console()
        describe(manifest, artifact_path, out)
        if verify:
            out.print("verify: all digests match" if not problems else "verify: FAILED")
    if problems:
        raise ArtifactError(
            f"{artifact_path}: {len(problems)} file(s) do not match the manifest:\n  "
            + "\n  ".join(problems)
        )


def _verify_problems(path: Path, mode: str) -> list[str]:
    """Each file of the artifact at `path` that does not match its manifest. `fast` trusts an
    unchanged directory's earlier full check (verified.py); where that check fails, the files
    are hashed again to list each mismatch."""
    from kiln.runtime.base.errors import ArtifactError
    from kiln.runtime.formats import artifact
    from kiln.runtime.formats.artifact.verified import verify_artifact

    if mode == "fast":
        try:
            verify_artifact(path, mode="fast", action="inspect it")
            return []
        except ArtifactError:
            pass  # listed file by file below
    return artifact.verify(path)
