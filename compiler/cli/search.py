"""`kiln search RECIPE`: the cheapest deployment of the recipe that passes its gate, per GPU
target. Exit 0 when some candidate passed on every target, 1 when a target has none (the
closest candidate and the check it missed named), 2 for a usage or recipe error. With --ray,
the candidates run as tasks on a Ray cluster (compiler/search/cluster/).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kiln.compiler.cli.consoles import console
from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import JSON_OPTION, REGISTRY_OPTION


@click.command("search")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--target", "targets", multiple=True, help="Price on this GPU (repeatable).")
@click.option(
    "--schemes", help="Schemes to try, comma-separated: fp8,fp8_dynamic,w8a8,w8a16,w4a16,..."
)
@click.option("--kv-cache", help="Comma-separated KV cache variants: none,fp8.")
@click.option("--no-mixed", is_flag=True, help="Skip the mixed-precision candidates.")
@click.option("--no-early-stop", is_flag=True, help="Gate every candidate in full.")
@click.option("--no-measure", is_flag=True, help="Do not time kiln's runtime on this machine.")
@click.option("--budget-hours", type=float, help="Stop before a candidate would pass this.")
@click.option("--max-candidates", type=int, help="Judge at most this many candidates.")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    help="Search directory (default: <recipe output>/search-<name>); rerun to resume.",
)
@click.option(
    "--ray",
    "ray_address",
    envvar="RAY_ADDRESS",
    metavar="ADDRESS",
    help="Run each candidate as a task on the Ray cluster whose head is at ADDRESS "
    "(host:port, or auto; default: $RAY_ADDRESS).",
)
@click.option(
    "--gpus-per-candidate",
    type=click.FloatRange(min=0),
    help="With --ray: GPUs each candidate's task takes (default 1 where the cluster has GPUs).",
)
@click.option(
    "--cpus-per-candidate",
    type=click.FloatRange(min=0),
    help="With --ray: CPUs each candidate's task takes (default 1).",
)
@REGISTRY_OPTION
@JSON_OPTION
@handle_errors
def search(
    recipe: Path,
    targets: tuple[str, ...],
    schemes: str | None,
    kv_cache: str | None,
    no_mixed: bool,
    no_early_stop: bool,
    no_measure: bool,
    budget_hours: float | None,
    max_candidates: int | None,
    output: Path | None,
    ray_address: str | None,
    gpus_per_candidate: float | None,
    cpus_per_candidate: float | None,
    registry_spec: str | None,
    as_json: bool,
) -> None:
    """Compile and gate each candidate deployment of RECIPE; print the Pareto table.

    \b
    Example:
      kiln search recipes/demo.yaml --target l40s --schemes w4a16,w8a16,fp8
      kiln search recipes/demo.yaml --ray auto --gpus-per-candidate 1 --json
    """
    from kiln.compiler.cli.progress import StepLog
    from kiln.compiler.cli.stdout_guard import stdout_to_stderr
    from kiln.compiler.recipe.recipe import load_recipe
    from kiln.compiler.search.cluster.connect import ClusterSettings
    from kiln.compiler.search.cluster.driver import fan_out
    from kiln.compiler.search.report import MARKDOWN
    from kiln.compiler.search.run import run_search
    from kiln.compiler.search.settings import command_line_settings
    from kiln.runtime.base.errors import UsageError, VerdictFailure

    cluster = None
    if ray_address:
        cpus = 1.0 if cpus_per_candidate is None else cpus_per_candidate
        cluster = ClusterSettings(ray_address.strip(), gpus_per_candidate, cpus)
    elif gpus_per_candidate is not None or cpus_per_candidate is not None:
        given = "--gpus" if gpus_per_candidate is not None else "--cpus"
        raise UsageError(
            f"{given}-per-candidate sizes a candidate's task on a Ray cluster: give --ray "
            "ADDRESS (or set RAY_ADDRESS), or leave it out"
        )

    parsed = load_recipe(recipe)
    settings = command_line_settings(
        parsed.config.search, targets=targets, schemes=schemes, kv_cache=kv_cache,
        no_mixed=no_mixed, no_early_stop=no_early_stop, no_measure=no_measure,
        budget_hours=budget_hours, max_candidates=max_candidates,
    )  # fmt: skip
    out_dir = output or parsed.output_dir() / f"search-{parsed.name}"
    began = time.monotonic()
    err = console(stderr=True)

    def elapsed() -> str:
        return f"[{time.monotonic() - began:6.0f}s]"

    # every step; a compile's per-layer counts at most every 10 s
    progress = StepLog(lambda line: err.print(line, markup=False), stamp=elapsed)

    with stdout_to_stderr(as_json):
        answer = run_search(recipe, settings, out_dir.resolve(), registry_spec, progress,
                            fan_out(cluster) if cluster else None)  # fmt: skip
    if as_json:
        click.echo(json.dumps(answer))
    else:
        click.echo((out_dir / MARKDOWN).read_text(), err=True)
        err.print(f"search reports: {out_dir}")
    lost = {t: d for t, d in answer["targets"].items() if d["winner"] is None}
    if lost:
        lines = []
        for target, data in lost.items():
            near = data["closest"]
            why = (f"closest {near['id']} missed {', '.join(near['failed_checks']) or 'the gate'}"
                   if near else "no candidate was judged")  # fmt: skip
            lines.append(f"{target}: no candidate passed the gate ({why})")
        raise VerdictFailure("; ".join(lines) + f"; see {out_dir}")
