"""`kiln gate`, `kiln promote`, `kiln rollback`, `kiln registry ...`: the gate's commands.

The compiler's CLI mounts these with `main.add_command(...)`. Exit codes follow kiln's:
0 pass, 1 verdict failure (a failing gate, or a promotion refused by a failing gate),
2 usage error, 3 runtime failure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.compiler.cli.exits import handle_errors
from kiln.compiler.cli.options import (
    JSON_OPTION,
    REGISTRY_OPTION,
    VERIFY_OPTION,
    KilnCommand,
    artifact_dir,
    old_spellings,
)
from kiln.runtime.base.errors import UsageError, VerdictFailure

if TYPE_CHECKING:
    from kiln.runtime.formats.artifact.verified import Mode


def _echo_err(message: str) -> None:
    click.echo(message, err=True)


def _open_registry(spec: str | None) -> Any:
    from kiln.gates.releases import Registry

    return Registry(spec)


# Old spellings keep working, unlisted: --shadow-log (now --mirror-log), --out (--output).
@click.command(
    "gate", cls=KilnCommand, context_settings=old_spellings({"shadow-log": "mirror-log",
                                                            "out": "output"})
)  # fmt: skip
@click.argument("candidate")
@click.option(
    "--baseline",
    required=True,
    help="An artifact dir, a float model source (HF dir), or an http(s) endpoint URL.",
)
@click.option("--gate-file", type=click.Path(path_type=Path), help="YAML `gates:` settings.")
@click.option(
    "--traffic",
    type=click.Path(path_type=Path),
    help="Recorded traffic (.jsonl) to replay through both sides.",
)
@click.option(
    "--mirror-log",
    type=click.Path(path_type=Path),
    help="Judge the mirror log of `kiln serve --mirror` (no tasks, no replay).",
)
@click.option(
    "--output",
    "out",
    type=click.Path(path_type=Path),
    help="Report directory (default: gate-reports/<candidate>-<digest>).",
)
@click.option("--limit", type=int, help="Items per task (overrides the gate settings).")
@click.option(
    "--engine",
    help="What evaluates the sides: kiln (in process, the default), kiln-serve, vllm, trtllm, "
    "or the URL of a running server (overrides gates.engine).",
)
@click.option(
    "--engine-arg",
    "engine_args",
    multiple=True,
    help="An argument appended to the candidate's engine command line, the serving "
    "configuration under test (repeatable), e.g. --engine-arg=--kv-cache-dtype=fp8.",
)
@click.option("--engine-target", help="trtllm: the artifact's target whose options to serve.")
@click.option(
    "--engine-model",
    help="--engine URL: the served model that is the candidate, where its /v1/models card "
    "names neither the artifact's name nor its digest (recorded as named, not checked).",
)
@REGISTRY_OPTION
@click.option("--no-record", is_flag=True, help="Do not record the run in the registry.")
@VERIFY_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print gate.json on stdout.")
@handle_errors
def gate(**given: Any) -> None:
    """Compare CANDIDATE with --baseline on lm-eval tasks, KL and shadow traffic; decide.

    \b
    Example:
      kiln gate artifacts/m-0c7038bf902e --baseline models/SmolLM2-135M-Instruct
      kiln gate http://10.0.0.5:8000/v1 --baseline http://10.0.0.6:8000 --traffic t.jsonl
    """
    run_gate_command(GateOptions(**given))


@dataclass(frozen=True, slots=True)
class GateOptions:
    """`kiln gate`'s command line."""

    candidate: str
    baseline: str
    gate_file: Path | None
    traffic: Path | None
    mirror_log: Path | None
    out: Path | None
    limit: int | None
    engine: str | None
    engine_args: tuple[str, ...]
    engine_target: str | None
    engine_model: str | None
    registry_spec: str | None
    no_record: bool
    verify: Mode
    as_json: bool


def run_gate_command(opts: GateOptions) -> None:
    """Load the gate settings, run the gate (or judge a mirror log), print and exit."""
    from kiln.gates.measure.served import parse_engine
    from kiln.gates.measure.sides import resolve_side
    from kiln.gates.report import to_markdown
    from kiln.gates.run import gate_mirror_log, run_gate
    from kiln.gates.settings import load_gate_file, load_gates
    from kiln.runtime.formats.artifact import load_manifest

    cand = resolve_side(opts.candidate, "candidate", opts.verify)
    base_dir, out = Path.cwd(), opts.out
    if opts.gate_file is not None:
        gates = load_gate_file(opts.gate_file)
        base_dir = opts.gate_file.resolve().parent
    elif cand.kind == "artifact" and cand.path is not None:
        section = load_manifest(cand.path).recipe.get("gates")
        gates = load_gates(section, f"{cand.path}/manifest.json recipe")
    else:
        gates = load_gates(None, "defaults")
    if opts.limit is not None:
        gates = gates.model_copy(update={"limit": opts.limit})
    engine = {"engine": opts.engine, "engine_args": list(opts.engine_args),
              "engine_target": opts.engine_target, "engine_model": opts.engine_model}  # fmt: skip
    if any(v for v in engine.values()):
        # its own words first
        parse_engine(opts.engine or gates.engine, opts.engine_args, model=opts.engine_model)
        given = {k: v for k, v in engine.items() if v}
        gates = load_gates({**gates.model_dump(), **given}, "--engine options")
    if out is None:
        label = cand.name if cand.kind == "http" else f"{cand.name}-{cand.digest[:12]}"
        out = Path("gate-reports") / re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")
    registry = None if opts.no_record else _open_registry(opts.registry_spec)
    if opts.mirror_log is not None:
        outcome = gate_mirror_log(
            opts.candidate,
            opts.baseline,
            opts.mirror_log,
            gates,
            out,
            registry=registry,
            verify=opts.verify,
        )
    else:
        outcome = run_gate(
            opts.candidate,
            opts.baseline,
            gates,
            out,
            base_dir=base_dir,
            traffic=opts.traffic,
            registry=registry,
            progress=_echo_err,
            verify=opts.verify,
        )
    verdict = outcome.verdict
    if opts.as_json:
        click.echo(json.dumps(verdict.to_dict(), sort_keys=True))
    else:
        click.echo(to_markdown(verdict))
        click.echo(f"reports: {outcome.reports['html']} (and gate.json, gate.md beside it)")
        if outcome.run_id is not None and registry is not None:
            click.echo(f"recorded as gate run {outcome.run_id} in {registry.path}")
    if not verdict.passed:
        failed = ", ".join(c.name for c in verdict.failed_checks)
        raise VerdictFailure(
            f"{opts.candidate}: gate failed against {opts.baseline} ({failed}); "
            f"see {outcome.reports['html']}"
        )


@click.command("promote", cls=KilnCommand)
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--channel", required=True, help="Release channel, e.g. prod or staging.")
@click.option("--reason", default="", help="Why (kept in the promotion history).")
@REGISTRY_OPTION
@VERIFY_OPTION
@JSON_OPTION
@handle_errors
def promote(
    artifact: Path,
    channel: str,
    reason: str,
    registry_spec: str | None,
    verify: Mode,
    as_json: bool,
) -> None:
    """Point CHANNEL at ARTIFACT; it must verify and have a passing gate run against the
    channel's baseline.

    \b
    Example:
      kiln promote artifacts/m-0c7038bf902e --channel prod --reason "passed the gate"
    """
    artifact_dir(artifact)
    with _open_registry(registry_spec) as registry:
        event = registry.promote(artifact, channel, reason, verify=verify)
    if as_json:
        click.echo(json.dumps(event))
        return
    previous = (event["previous_digest"] or "nothing")[:12]
    click.echo(f"{channel}: {event['digest'][:12]} (was {previous})")


@click.command("rollback", cls=KilnCommand)
@click.argument("channel")
@click.option("--reason", default="", help="Why (kept in the promotion history).")
@REGISTRY_OPTION
@VERIFY_OPTION
@JSON_OPTION
@handle_errors
def rollback(
    channel: str, reason: str, registry_spec: str | None, verify: Mode, as_json: bool
) -> None:
    """Move CHANNEL back to the artifact it served before its current one, once that artifact
    verifies against the digest CHANNEL recorded.

    \b
    Example:
      kiln rollback prod --reason "p99 latency regression"
    """
    with _open_registry(registry_spec) as registry:
        event = registry.rollback(channel, reason, verify=verify)
    if as_json:
        click.echo(json.dumps(event))
        return
    click.echo(
        f"{channel}: {event['digest'][:12]} (rolled back from {event['previous_digest'][:12]})"
    )


@click.group("registry")
def registry() -> None:
    """Inspect and configure the artifact registry.

    \b
    Example:
      kiln registry ls
      kiln registry history prod --json
    """


@registry.command("ls")
@REGISTRY_OPTION
@JSON_OPTION
@handle_errors
def registry_ls(registry_spec: str | None, as_json: bool) -> None:
    """Channels with what they serve, and the latest gate runs.

    \b
    Example:
      kiln registry ls --registry sqlite:////srv/kiln/registry.db
    """
    from dataclasses import asdict

    with _open_registry(registry_spec) as reg:
        channels, runs = reg.ls(), reg.gate_runs()[:20]
    if as_json:
        click.echo(json.dumps({"channels": [asdict(c) for c in channels], "gate_runs": runs}))
        return
    click.echo("channels:" if channels else "channels: none")
    for c in channels:
        serving = f"{c.current_name} {c.current_digest[:12]}" if c.current_digest else "nothing"
        rule = c.baseline_rule + (f" {c.baseline_digest[:12]}" if c.baseline_digest else "")
        click.echo(f"  {c.name:<16} {serving:<40} baseline rule: {rule}")
    click.echo("gate runs:" if runs else "gate runs: none")
    for r in runs:
        status = "pass" if r["passed"] else "FAIL"
        click.echo(
            f"  #{r['id']:<4} {status}  {r['candidate_digest'][:12]} vs "
            f"{r['baseline'][:40]:<40} {r['created_at']}"
        )


@registry.command("history")
@click.argument("channel")
@REGISTRY_OPTION
@JSON_OPTION
@handle_errors
def registry_history(channel: str, registry_spec: str | None, as_json: bool) -> None:
    """The promotion and rollback events of CHANNEL, oldest first.

    \b
    Example:
      kiln registry history prod
    """
    with _open_registry(registry_spec) as reg:
        reg.require_channel(channel, "`kiln registry ls` lists them")
        events = reg.history(channel)
    if as_json:
        click.echo(json.dumps({"channel": channel, "events": events}))
        return
    if not events:
        click.echo(f"{channel}: no promotions yet")
    for e in events:
        click.echo(
            f"{e['created_at']}  {e['action']:<8} {(e['digest'] or '')[:12]}  "
            f"(was {(e['previous_digest'] or 'nothing')[:12]})  {e['actor']}  {e['reason']}"
        )


@registry.command("channel")
@click.argument("name")
@click.option(
    "--rule",
    type=click.Choice(["current", "fixed"]),
    help="What candidates are gated against: `current`, what the channel serves (the float "
    "source while it serves nothing); `fixed`, the --baseline digest. Given, it creates or "
    "changes the channel; without --rule or --baseline the channel is shown.",
)
@click.option(
    "--baseline",
    "baseline_digest",
    metavar="DIGEST",
    help="The digest every candidate must be gated against (implies --rule fixed).",
)
@REGISTRY_OPTION
@JSON_OPTION
@handle_errors
def registry_channel(
    name: str,
    rule: str | None,
    baseline_digest: str | None,
    registry_spec: str | None,
    as_json: bool,
) -> None:
    """Show channel NAME, or create or configure it with --rule: which baseline its candidates
    must be gated against.

    \b
    Example:
      kiln registry channel prod
      kiln registry channel staging --rule current
      kiln registry channel prod --rule fixed --baseline 2459fc69cb20...
    """
    from dataclasses import asdict

    if baseline_digest and rule == "current":
        raise UsageError(
            f"channel {name}: --baseline is the digest of rule `fixed`; rule `current` gates "
            "against what the channel serves: drop --baseline, or use --rule fixed"
        )
    with _open_registry(registry_spec) as reg:
        if rule is None and baseline_digest is None:
            create = f"create it with `kiln registry channel {name} --rule current` (or "
            state = reg.require_channel(name, create + "--rule fixed --baseline DIGEST)")
        else:
            rule = rule or "fixed"
            reg.configure_channel(name, rule, baseline_digest)
            state = reg.require_channel(name, "")
    if as_json:
        click.echo(json.dumps(asdict(state)))
        return
    serving = f"{state.current_name} {state.current_digest[:12]}" if state.current_digest else ""
    rule_text = state.baseline_rule + (f" {state.baseline_digest}" if state.baseline_digest else "")
    click.echo(f"{state.name}: baseline rule {rule_text}; serves {serving or 'nothing'}")
