"""The gate as the last step of `kiln compile`, and `kiln compile --promote CHANNEL`.

When the recipe has a `gates:` section, the freshly published artifact is gated against a
baseline and the verdict is recorded three times: the reports (gate.json, gate.md,
gate.html) beside the artifact in `<output>/gate-reports/<name>-<digest12>/`, a summary in
the artifact's manifest.json (`gate`; the manifest is outside the content digest, so the
artifact's identity does not change), and a gate run in the registry. With `--promote`, a
passing verdict then promotes the artifact through the registry's own rules, so a failing
gate (or a channel that requires another baseline) leaves the channel untouched.

The baseline is, in order: what `--promote CHANNEL` requires (the artifact the channel
serves now, or its fixed baseline), else `gates.baseline` (`source` = the recipe's
unquantised model as the source stage materialised it).

Like every stage, the gate is keyed by its inputs (artifact digest, baseline digest,
settings, traffic file): an unchanged re-run reuses the verdict the registry recorded for
those two digests, and only while gate.json still agrees with it; a registry without that
run, or a gate.json edited since, runs the gate again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.compiler.compile import CompileResult
from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.stages import input_key
from kiln.gates.measure.served import engine_unavailable
from kiln.gates.measure.sides import SideSpec, resolve_side
from kiln.gates.releases import Registry, check_channel
from kiln.gates.settings import GatesSection
from kiln.runtime.base.errors import ArtifactError, UsageError
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact import GateRecord

GATE_REPORTS_DIR = "gate-reports"

Progress = Callable[[str], None]


@dataclass(slots=True)
class GateStep:
    """What the gate step did: its verdict (gate.json's content), reports and registry run."""

    verdict: dict[str, Any]
    reports_dir: Path
    baseline: SideSpec
    cached: bool
    run_id: int | None = None
    promotion: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return bool(self.verdict.get("passed"))

    @property
    def failed_checks(self) -> list[str]:
        return [c["name"] for c in self.verdict.get("checks", []) if not c.get("passed")]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "cached": self.cached,
            "baseline": self.baseline.to_dict(),
            "failed_checks": self.failed_checks,
            "reports": str(self.reports_dir),
            "run_id": self.run_id,
            "promotion": self.promotion,
        }


def check_gate_options(recipe: Recipe, promote: str | None, gate: bool) -> None:
    """Refuse `--promote` without a gate, and a gate on an engine this machine lacks, before
    any compile work starts."""
    gates = recipe.config.gates
    missing = engine_unavailable(gates.engine) if gate and gates is not None else None
    if missing is not None:
        raise UsageError(
            f"{recipe.where('gates.engine')}: gates.engine: {missing} — compile with --no-gate "
            "here and run `kiln gate ARTIFACT --engine ...` where the engine is installed"
        )
    if promote is None:
        return
    check_channel(promote)
    if not gate:
        raise UsageError(
            f"--promote {promote} with --no-gate: nothing is promoted without a passing gate; "
            "drop --no-gate"
        )
    if recipe.config.gates is None:
        raise UsageError(
            f"{recipe.path}: --promote {promote} needs a gate, and the recipe has no `gates:` "
            "section; add one (`gates: {}` takes the default tasks and thresholds)"
        )


def gate_compiled(
    result: CompileResult,
    recipe: Recipe,
    *,
    registry: Registry,
    promote: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> GateStep | None:
    """Gate the compiled artifact when the recipe asks for it; promote on pass if asked."""
    gates = recipe.config.gates
    if gates is None:
        return None
    from kiln.gates.decide.verdict import GATE_JSON
    from kiln.gates.run import run_gate

    say = progress or (lambda _msg: None)
    path = result.artifact
    manifest = artifact.load_manifest(path)
    baseline, required = _baseline(recipe, gates, result, registry, promote, manifest.digest)
    base = resolve_side(baseline, "baseline")
    if required is not None and base.digest != required:  # identity is the digest, not the path
        raise ArtifactError(
            f"--promote {promote}: the channel requires a gate against {required[:12]}, "
            f"registered at {baseline}, but that directory now holds {base.name} "
            f"({base.digest[:12]}); put artifact {required[:12]} back there (or `kiln registry` "
            "the channel to another baseline), then compile again"
        )
    base_dir = recipe.base_dir("gates")
    traffic = _traffic(gates, base_dir)
    key = input_key("gate", manifest.digest, base.digest, gates.model_dump(), traffic)
    out_dir = path.parent / GATE_REPORTS_DIR / _safe(f"{manifest.name}-{manifest.digest[:12]}")
    gate_json = out_dir / GATE_JSON
    recorded = manifest.gate
    cached = None
    if not force and recorded is not None and recorded.key == key:
        cached = _recorded_verdict(registry, gate_json, manifest.digest, base.digest)
    if cached is not None:
        run_id, verdict = cached
        step = GateStep(verdict, out_dir, base, True, run_id)
    else:
        say(f"gate: {manifest.name} against {base.name} ({base.kind})")
        outcome = run_gate(
            str(path), baseline, gates, out_dir, base_dir=base_dir, registry=registry,
            progress=say,
        )  # fmt: skip
        step = GateStep(outcome.verdict.to_dict(), out_dir, base, False, outcome.run_id)
        record = GateRecord(
            key=key,
            passed=step.passed,
            baseline=base.to_dict(),
            failed_checks=step.failed_checks,
            reports=str(out_dir),
            seconds=step.verdict.get("seconds"),
            run_id=step.run_id,
        )
        # The gate ran for minutes with the output lock released: record it on the manifest
        # as it is now, under the artifact's manifest lock, so no other writer's update is lost.
        artifact.update_manifest(path, lambda now: setattr(now, "gate", record))
    if promote is not None and step.passed:
        state = registry.channel(promote)
        if state is None or state.current_digest != manifest.digest:  # a re-run is a no-op
            # Bound to this verdict: the registry refuses if the channel moved while it ran.
            step.promotion = registry.promote(path, promote, reason=f"kiln compile {recipe.path}",
                                              gate_run=step.run_id)  # fmt: skip
    return step


def _baseline(
    recipe: Recipe,
    gates: GatesSection,
    result: CompileResult,
    registry: Registry,
    promote: str | None,
    candidate: str,
) -> tuple[str, str | None]:
    """The baseline spec and the digest it must have: the channel's requirement, else
    `gates.baseline` (whatever digest it has)."""
    if promote is not None:
        state = registry.channel(promote)
        if state is not None:
            fixed = state.baseline_rule == "fixed"
            required = state.baseline_digest if fixed else state.current_digest
            if required is not None and required != candidate:  # else: a re-run, already there
                rows = [a for a in registry.artifacts() if a["digest"] == required]
                where = rows[0]["path"] if rows else None
                if where is None or not (Path(where) / artifact.MANIFEST).is_file():
                    why = "its fixed baseline" if fixed else "the artifact it serves now"
                    raise UsageError(
                        f"--promote {promote}: the channel requires a gate against {why} "
                        f"({required[:12]}), but that artifact is not on disk "
                        f"({where or 'never registered with a path'}); restore it, or "
                        f"`kiln registry` the channel to another baseline"
                    )
                return where, required
    if gates.baseline != "source":
        spec = gates.baseline
        if "://" not in spec and not Path(spec).expanduser().is_absolute():
            spec = str(recipe.base_dir("gates.baseline") / spec)
        return spec, None
    if result.source_model is None or not result.source_model.is_dir():
        raise UsageError(
            f"{recipe.path}: gates.baseline is `source` but the source model is not "
            "materialised; re-run `kiln compile` (or set gates.baseline to a model directory)"
        )
    return str(result.source_model), None


def _traffic(gates: GatesSection, base_dir: Path) -> str | None:
    """The recorded traffic file's digest: a new recording re-runs the gate."""
    if gates.shadow.traffic is None:
        return None
    path = Path(gates.shadow.traffic).expanduser()
    path = path if path.is_absolute() else base_dir / path
    return artifact.sha256_file(path) if path.is_file() else str(path)


def _recorded_verdict(
    registry: Registry, gate_json: Path, candidate: str, baseline: str
) -> tuple[int, dict[str, Any]] | None:
    """(run id, verdict) of this registry's latest run of `candidate` against `baseline`,
    when gate.json beside the artifact still says exactly that; else None and the gate runs
    again. gate.json lies outside the digest: alone it is never trusted, nor recorded."""
    try:
        on_disk = json.loads(gate_json.read_text())
    except (OSError, ValueError):
        return None
    for run in registry.gate_runs(candidate):
        if run["baseline"] == baseline:
            verdict = registry.verdict(int(run["id"]))
            return (int(run["id"]), verdict) if verdict == on_disk else None
    return None


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")
