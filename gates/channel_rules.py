"""What a channel's baseline rule allows, read from the registry's tables inside its write
transaction: the gate run a promotion needs (gates/releases.py's module docstring states the
rules), and the digest a rollback moves a channel back to.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError, VerdictFailure


def require_passing_run(
    db: sqlite3.Connection,
    path: Path,
    name: str,
    digest: str,
    channel: str,
    required: str | None,
    why: str,
    run_id: int | None = None,
) -> None:
    """Refuse to promote `digest` to `channel` unless a passing gate run judged it against
    what the channel requires (`required`, because `why`; None: the float source), or, with
    `run_id`, unless that run did."""
    refusal = f"{path}: refusing to promote {name} ({digest[:12]}) to {channel}"
    if run_id is not None:
        require_run(db, run_id, refusal, digest, channel, required, why)
    gated = [
        {**dict(r), "passed": passed_run(r, _file(db))}
        for r in db.execute(
            "SELECT id, candidate_digest, baseline, baseline_kind, passed, verdict FROM gate_runs "
            "WHERE candidate_digest = ? AND baseline != candidate_digest",
            (digest,),
        )
    ]
    # An empty channel: only a run against the float source opens it.
    runs = [r for r in gated if required is not None or r["baseline_kind"] == "source"]
    if any(r["passed"] and (required is None or r["baseline"] == required) for r in runs):
        return
    if required is None:
        against, hint = "against its float source", "<the float source checkpoint>"
    else:
        row = db.execute("SELECT path FROM artifacts WHERE digest = ?", (required,)).fetchone()
        against, hint = f"against {required[:12]}", row["path"] if row else required
    fix = f"run `kiln gate {path} --baseline {hint}` first"
    if not gated:
        raise UsageError(f"{refusal}: it has never been gated; {fix}")
    if not runs:
        kinds = ", ".join(sorted({f"{r['baseline_kind']} {r['baseline'][:12]}" for r in gated}))
        raise UsageError(
            f"{refusal}: {channel} serves nothing yet, so it opens only with a passing gate "
            f"run against the float source (the model before quantisation), and this "
            f"artifact was gated only against {kinds}; {fix}"
        )
    if required is not None and not any(r["baseline"] == required for r in runs):
        others = ", ".join(sorted({r["baseline"][:12] for r in runs}))
        raise UsageError(
            f"{refusal}: {channel} requires a passing gate run {against} ({why}), "
            f"but it was gated only against {others}; {fix}"
        )
    raise VerdictFailure(
        f"{refusal}: its gate runs {against} failed; fix the candidate or the gate "
        f"thresholds, then {fix}"
    )


def passed_run(run: sqlite3.Row | dict[str, Any], where: str | Path) -> bool:
    """Whether gate run `run` passed: its `passed` column, which a promotion may trust only
    where the verdict stored with it says the same of the same candidate and baseline. A
    disagreement is a registry edited or damaged past what SQLite's checks find: an error,
    never a pass."""
    if not run["passed"]:
        return False
    why = None
    try:
        verdict = json.loads(run["verdict"])
        candidate, baseline = verdict["candidate"]["digest"], verdict["baseline"]["digest"]
        said = (verdict.get("passed"), candidate, baseline)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"cannot be read ({type(exc).__name__})"
    else:
        if said != (True, run["candidate_digest"], run["baseline"]):
            why = f"says passed={said[0]!r} of {str(said[1])[:12]} against {str(said[2])[:12]}"
    if why is None:
        return True
    raise UsageError(
        f"registry {where}: its gate run {run['id']} is marked passed, but the verdict stored "
        f"with it {why}: the registry file was edited or damaged; restore it from a backup, "
        "or gate the artifact again (a fresh registry: move the file away)"
    )


def _file(db: sqlite3.Connection) -> str:
    """The file `db` is opened on."""
    return str(db.execute("PRAGMA database_list").fetchone()[2])


def require_run(
    db: sqlite3.Connection,
    run_id: int,
    refusal: str,
    digest: str,
    channel: str,
    required: str | None,
    why: str,
) -> None:
    """Refuse (`refusal` names the artifact and channel) unless gate run `run_id` judged this
    candidate against what `channel` requires now (`required`, because `why`): read inside
    the write transaction, so a promotion since the gate started shows here."""
    run = db.execute(
        "SELECT id, candidate_digest, baseline, baseline_kind, passed, verdict FROM gate_runs "
        "WHERE id = ?",
        (run_id,),
    ).fetchone()
    if run is None or run["candidate_digest"] != digest:
        raise UsageError(
            f"{refusal}: gate run {run_id} is not a gate run of this artifact; gate it and "
            "promote then"
        )
    judged = f"{run['baseline_kind']} {run['baseline'][:12]}"
    if not passed_run(run, _file(db)):
        raise VerdictFailure(f"{refusal}: gate run {run_id} against {judged} failed")
    if required is None and run["baseline_kind"] != "source":
        raise UsageError(
            f"{refusal}: gate run {run_id} judged it against {judged}, but {channel} serves "
            "nothing now, so it opens only with a pass against the float source; gate it "
            "against its source and promote then"
        )
    if required is not None and run["baseline"] != required:
        raise UsageError(
            f"{refusal}: gate run {run_id} judged it against {judged}, but {channel} now "
            f"requires a pass against {required[:12]} ({why}): the channel changed since "
            f"the gate started; gate it against {required[:12]} (`kiln compile --promote "
            f"{channel}` again does) and promote then"
        )


def unknown_channel(db: sqlite3.Connection, channel: str, where: Path, fix: str) -> UsageError:
    """The error for a channel the registry at `where` does not hold, naming those it does."""
    names = [row["name"] for row in db.execute("SELECT name FROM channels ORDER BY name")]
    known = f"it has {', '.join(names)}" if names else "it has no channels yet"
    return UsageError(f"channel {channel}: no such channel in {where} ({known})"
                      + (f"; {fix}" if fix else ""))  # fmt: skip


def rollback_step(db: sqlite3.Connection, channel: str, where: Path) -> tuple[str, str]:
    """(the digest a rollback moves `channel` to, the one it serves now)."""
    state = db.execute("SELECT * FROM channels WHERE name = ?", (channel,)).fetchone()
    if state is None:
        raise unknown_channel(db, channel, where, "`kiln registry ls` lists them")
    stack: list[str] = []
    for event in db.execute(
        "SELECT action, digest FROM promotion_events WHERE channel = ? ORDER BY id",
        (channel,),
    ):
        if event["action"] == "promote":
            stack.append(event["digest"])
        elif stack:
            stack.pop()
    if len(stack) < 2:
        raise UsageError(
            f"channel {channel}: nothing to roll back to (it has served only "
            f"{stack[0][:12] if stack else 'nothing'}); promote an artifact instead"
        )
    return stack[-2], stack[-1]
