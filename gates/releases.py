"""The artifact registry: gate runs, release channels, and promotion / rollback history.

One SQLite file (WAL journal). Every write runs inside `BEGIN IMMEDIATE`, which takes the
database's write lock before reading, so two processes promoting to one channel at once
are serialised: the second sees the first's result and is judged against it. A refused
promotion raises before COMMIT and changes nothing.

Which baseline a channel requires (`channels.baseline_rule`):
- ``current`` (default): a passing gate run of the candidate against the artifact the
  channel serves now; an empty channel opens only with a passing run against a float
  source checkpoint (baseline kind `source`: the model before quantisation), never one
  against another artifact or an endpoint, which would only say the candidate is no worse
  than something the channel never vouched for.
- ``fixed``: a passing gate run against the channel's configured `baseline_digest` (for
  example the float source's content digest), whatever the channel serves.

A gate run is bound to both digests: it is recorded only for the artifact its verdict names
as the candidate, and never when candidate and baseline are the same content; such a run
counts for nothing.

Rollback replays the channel's events as a stack (promote pushes, rollback pops) and moves
to the digest below the top, so repeated rollbacks walk back through history.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

from kiln.gates.channel_rules import (
    passed_run,
    require_passing_run,
    rollback_step,
    unknown_channel,
)
from kiln.runtime.base.errors import ArtifactError, KilnError, UsageError
from kiln.runtime.base.files import regular_problem
from kiln.runtime.formats.artifact import json_dumps, load_manifest
from kiln.runtime.formats.artifact.verified import Mode, verify_artifact

ENV_VAR = "KILN_REGISTRY"
# How long a write waits for another process's write transaction before giving up.
LOCK_WAIT_S = 60.0
BASELINE_RULES = ("current", "fixed")
F = TypeVar("F", bound=Callable[..., Any])

_SCHEMA = """
CREATE TABLE IF NOT EXISTS artifacts (
    digest TEXT PRIMARY KEY, name TEXT NOT NULL, path TEXT NOT NULL,
    recipe TEXT NOT NULL, manifest TEXT NOT NULL, registered_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS gate_runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, candidate_digest TEXT NOT NULL,
    baseline TEXT NOT NULL, baseline_kind TEXT NOT NULL, passed INTEGER NOT NULL,
    verdict TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS gate_runs_candidate ON gate_runs (candidate_digest);
CREATE TABLE IF NOT EXISTS channels (
    name TEXT PRIMARY KEY,
    baseline_rule TEXT NOT NULL DEFAULT 'current' CHECK (baseline_rule IN ('current', 'fixed')),
    baseline_digest TEXT, current_digest TEXT, updated_at TEXT);
CREATE TABLE IF NOT EXISTS promotion_events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, channel TEXT NOT NULL, digest TEXT,
    previous_digest TEXT, action TEXT NOT NULL CHECK (action IN ('promote', 'rollback')),
    reason TEXT NOT NULL, actor TEXT NOT NULL, created_at TEXT NOT NULL);
"""


def default_path() -> Path:
    """$KILN_REGISTRY, else $XDG_DATA_HOME/kiln/registry.db (~/.local/share by default)."""
    if os.environ.get(ENV_VAR):
        return registry_path(os.environ[ENV_VAR])
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kiln" / "registry.db"


def registry_path(spec: str) -> Path:
    """A path, or an SQLAlchemy-style URL: sqlite:///relative.db, sqlite:////abs/path.db."""
    if "://" not in spec:
        return Path(spec).expanduser()
    if not spec.startswith("sqlite:///"):
        raise UsageError(
            f"registry {spec!r}: only SQLite is supported; pass a file path or "
            "sqlite:///relative.db / sqlite:////absolute/path.db"
        )
    path = spec[len("sqlite:///") :]
    if not path:
        raise UsageError(
            f"registry {spec!r} names no file; write sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    return Path(path).expanduser()


CHANNEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_channel(name: str) -> str:
    """`name` if it is a channel name (letters, digits, '.', '_', '-'; at most 64, starting
    with a letter or digit); UsageError saying so otherwise."""
    if not CHANNEL_NAME.match(name):
        raise UsageError(
            f"channel {name!r}: a channel name is 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. prod, staging-eu)"
        )
    return name


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def default_actor() -> str:
    """$KILN_ACTOR, else user@host: who a promotion event is attributed to."""
    return os.environ.get("KILN_ACTOR") or f"{getpass.getuser()}@{socket.gethostname()}"


# SQLite's result codes for a file it finds damaged: in its header, or a page a query reaches.
_DAMAGE = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def _sqlite_code(exc: sqlite3.Error) -> int:
    """SQLite's primary result code of `exc` (SQLITE_CORRUPT, ...); 0 when it has none."""
    return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF


def _names_damage(method: F) -> F:
    """Wrap a Registry method: SQLite finding the file damaged, wherever it reads or writes,
    is a UsageError naming the file and what to do."""

    @wraps(method)
    def wrapper(self: Registry, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as exc:
            if not _is_damage(exc):
                raise
            raise damaged(self.path, str(exc)) from None

    return wrapper  # type: ignore[return-value]


def _is_damage(exc: sqlite3.DatabaseError) -> bool:
    """SQLite found a damaged page, or a text column holds bytes no UTF-8 text is (a page
    overwritten with other bytes that SQLite's structure checks pass)."""
    return _sqlite_code(exc) in _DAMAGE or "Could not decode to UTF-8" in str(exc)


def damaged(path: Path, what: str) -> UsageError:
    """The error for a registry file found damaged: what was found, that nothing changed,
    and the ways back."""
    return UsageError(
        f"registry {path}: the file is damaged ({what}); nothing was changed. The "
        "artifacts are not in this file and are unaffected: it records gate runs, "
        "channels and promotions. Restore it from a backup, or salvage what is readable "
        f"with `sqlite3 {path} .recover | sqlite3 recovered.db`, or move it away "
        "and kiln starts a fresh registry there on its next command (gate and promote "
        "the artifacts again)"
    )


@dataclass(slots=True)
class ChannelState:
    name: str
    baseline_rule: str
    baseline_digest: str | None
    current_digest: str | None
    current_name: str | None
    current_path: str | None
    updated_at: str | None


class Registry:
    """Gate runs, channels and promotions in one SQLite file."""

    def __init__(self, path: str | Path | None = None, lock_wait_s: float = LOCK_WAIT_S) -> None:
        """`lock_wait_s`: how long a write waits for another process's write to finish."""
        self.path = registry_path(str(path)) if path is not None else default_path()
        self.lock_wait_s = lock_wait_s
        if self.path.exists() and (why := regular_problem(self.path)) is not None:
            raise UsageError(f"registry {self.path}: {why}; point --registry at a registry file")
        fresh = not os.path.lexists(self.path)
        try:
            self._open()
        except BaseException:
            if (db := getattr(self, "_db", None)) is not None:
                db.close()
            if fresh:  # a registry this call began and could not finish (a full disk)
                for leftover in ("", "-wal", "-shm", "-journal"):
                    Path(f"{self.path}{leftover}").unlink(missing_ok=True)
            raise

    def _open(self) -> None:
        """Connect, check every page, and create the tables a fresh file lacks."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=self.lock_wait_s, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute(f"PRAGMA busy_timeout = {int(self.lock_wait_s * 1000)}")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA foreign_keys = ON")
            # A page overwritten in place reads back as an empty table, or not at all only
            # when a query reaches it: every page is checked once, here (a registry is small).
            found = [r[0] for r in self._db.execute("PRAGMA quick_check(5)")]
            if found != ["ok"]:
                raise damaged(self.path, "; ".join(map(str, found))[:300])
            with self._write() as db:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
        except sqlite3.DatabaseError as exc:
            if _sqlite_code(exc) == sqlite3.SQLITE_FULL:
                raise  # the CLI says the disk is full
            if _sqlite_code(exc) not in _DAMAGE:
                raise UsageError(f"registry {self.path}: cannot be opened ({exc})") from None
            raise UsageError(  # not SQLite at all, or damaged from its first page
                f"registry {self.path}: not a kiln registry, or a damaged one ({exc}); point "
                f"--registry (or ${ENV_VAR}) at the registry file; if this is it, restore it "
                "from a backup (the artifacts themselves are intact), or move it away to "
                "start a new one"
            ) from None
        except OSError as exc:
            raise UsageError(f"registry {self.path}: cannot be opened ({exc.strerror})") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction holding the write lock from its first read; a KilnError
        naming the registry when another process holds that lock past `lock_wait_s`."""
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            raise KilnError(
                f"registry {self.path}: another process has held its write lock for "
                f"{self.lock_wait_s:g} s (a promotion, rollback or gate run in progress); "
                "nothing was changed: retry when it has finished"
            ) from None
        try:
            yield self._db
        except BaseException:
            if self._db.in_transaction:  # SQLite may have rolled back already (a damaged page)
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- artifacts and gate runs ------------------------------------------------------

    def _upsert_artifact(self, db: sqlite3.Connection, path: Path) -> str:
        manifest = load_manifest(path)
        db.execute(
            "INSERT INTO artifacts (digest, name, path, recipe, manifest, registered_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (digest) DO UPDATE SET path = excluded.path",
            (
                manifest.digest,
                manifest.name,
                str(path.resolve()),
                json_dumps(manifest.recipe),
                json_dumps(manifest.to_dict()),
                _now(),
            ),
        )
        return manifest.digest

    @_names_damage
    def record_gate_run(self, verdict: dict[str, Any], artifact_path: str | Path | None) -> int:
        """Store a gate.json verdict (and register the candidate artifact, which must be the
        one the verdict names); returns its id."""
        candidate, baseline = verdict["candidate"], verdict["baseline"]
        if candidate["digest"] == baseline["digest"]:
            raise UsageError(
                f"gate run of {candidate['digest'][:12]}: its baseline is the candidate itself; "
                "such a run proves nothing and is not recorded"
            )
        with self._write() as db:
            if artifact_path is not None:
                registered = self._upsert_artifact(db, Path(artifact_path))
                if registered != candidate["digest"]:
                    raise UsageError(
                        f"{artifact_path}: its digest is {registered[:12]}, but the verdict is "
                        f"for {candidate['digest'][:12]}; record a verdict with the artifact "
                        "it judged"
                    )
            cursor = db.execute(
                "INSERT INTO gate_runs (candidate_digest, baseline, baseline_kind, passed, "
                "verdict, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    candidate["digest"],
                    baseline["digest"],
                    baseline["kind"],
                    int(bool(verdict["passed"])),
                    json_dumps(verdict),
                    _now(),
                ),
            )
            return int(cursor.lastrowid or 0)

    @_names_damage
    def gate_runs(self, candidate_digest: str | None = None) -> list[dict[str, Any]]:
        """Gate runs, newest first (of one candidate digest when given)."""
        sql = "SELECT id, candidate_digest, baseline, baseline_kind, passed, created_at, "
        sql += "verdict FROM gate_runs"
        rows = (
            self._db.execute(
                sql + " WHERE candidate_digest = ? ORDER BY id DESC", (candidate_digest,)
            )
            if candidate_digest
            else self._db.execute(sql + " ORDER BY id DESC")
        )
        runs = [{**dict(r), "passed": int(passed_run(r, self.path))} for r in rows]
        return [{k: v for k, v in r.items() if k != "verdict"} for r in runs]

    @_names_damage
    def verdict(self, run_id: int) -> dict[str, Any]:
        """The stored gate.json of one run."""
        row = self._db.execute("SELECT verdict FROM gate_runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise UsageError(f"gate run {run_id}: no such run; `kiln registry ls` lists them")
        return dict(json.loads(row["verdict"]))

    # -- channels ---------------------------------------------------------------------

    @_names_damage
    def configure_channel(
        self, channel: str, baseline_rule: str = "current", baseline_digest: str | None = None
    ) -> None:
        """Create or change a channel's baseline rule (see the module docstring)."""
        check_channel(channel)
        if baseline_rule not in BASELINE_RULES:
            raise UsageError(
                f"channel {channel}: baseline rule {baseline_rule!r} is not one of "
                f"{', '.join(BASELINE_RULES)}"
            )
        if baseline_rule == "fixed" and not baseline_digest:
            raise UsageError(
                f"channel {channel}: rule `fixed` needs a baseline digest (the artifact or "
                "source digest every candidate must be gated against)"
            )
        with self._write() as db:
            db.execute(
                "INSERT INTO channels (name, baseline_rule, baseline_digest, updated_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                "baseline_rule = excluded.baseline_rule, "
                "baseline_digest = excluded.baseline_digest",
                (channel, baseline_rule, baseline_digest, _now()),
            )

    @_names_damage
    def channel(self, name: str) -> ChannelState | None:
        row = self._db.execute(
            "SELECT c.*, a.name AS current_name, a.path AS current_path FROM channels c "
            "LEFT JOIN artifacts a ON a.digest = c.current_digest WHERE c.name = ?",
            (name,),
        ).fetchone()
        return None if row is None else _channel_state(row)

    @_names_damage
    def require_channel(self, name: str, fix: str) -> ChannelState:
        """The channel `name`; UsageError naming the channels there are, and `fix`, where the
        registry holds none of that name."""
        state = self.channel(check_channel(name))
        if state is None:
            raise unknown_channel(self._db, name, self.path, fix)
        return state

    @_names_damage
    def ls(self) -> list[ChannelState]:
        """Every channel with what it serves now."""
        rows = self._db.execute(
            "SELECT c.*, a.name AS current_name, a.path AS current_path FROM channels c "
            "LEFT JOIN artifacts a ON a.digest = c.current_digest ORDER BY c.name"
        )
        return [_channel_state(r) for r in rows]

    @_names_damage
    def artifacts(self) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT digest, name, path, registered_at FROM artifacts ORDER BY registered_at"
        )
        return [dict(r) for r in rows]

    @_names_damage
    def history(self, channel: str) -> list[dict[str, Any]]:
        """The channel's promotion events, oldest first."""
        rows = self._db.execute(
            "SELECT * FROM promotion_events WHERE channel = ? ORDER BY id", (channel,)
        )
        return [dict(r) for r in rows]

    # -- promotion --------------------------------------------------------------------

    @_names_damage
    def promote(
        self,
        artifact_path: str | Path,
        channel: str,
        reason: str = "",
        actor: str | None = None,
        verify: Mode = "fast",
        gate_run: int | None = None,
    ) -> dict[str, Any]:
        """Point `channel` at the artifact, if it verifies and a passing gate run allows it;
        returns the event. `gate_run`: only that run may allow it (a caller promoting on the
        verdict it just got), judged against what the channel requires when it is promoted."""
        check_channel(channel)
        path = Path(artifact_path)
        # Hashing is slow: outside the write lock.
        manifest = verify_artifact(path, mode=verify, action=f"promote it to {channel}").manifest
        digest, actor = manifest.digest, actor or default_actor()
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO channels (name) VALUES (?)", (channel,))
            state = db.execute("SELECT * FROM channels WHERE name = ?", (channel,)).fetchone()
            current = state["current_digest"]
            if current == digest:
                raise UsageError(
                    f"{path}: {manifest.name} ({digest[:12]}) already serves {channel}"
                )
            fixed = state["baseline_rule"] == "fixed"
            required = state["baseline_digest"] if fixed else current
            why = "its fixed baseline" if fixed else "what it serves now"
            require_passing_run(db, path, manifest.name, digest, channel, required, why,
                                      gate_run)  # fmt: skip
            self._upsert_artifact(db, path)
            db.execute(
                "UPDATE channels SET current_digest = ?, updated_at = ? WHERE name = ?",
                (digest, _now(), channel),
            )
            return self._event(db, channel, digest, current, "promote", reason, actor)

    @_names_damage
    def rollback(
        self, channel: str, reason: str = "", actor: str | None = None, verify: Mode = "fast"
    ) -> dict[str, Any]:
        """Move the channel back to the artifact it served before its current one, once that
        artifact verifies against the digest the channel recorded for it."""
        check_channel(channel)
        actor = actor or default_actor()
        target, _ = rollback_step(self._db, channel, self.path)
        row = self._db.execute("SELECT path FROM artifacts WHERE digest = ?", (target,)).fetchone()
        where = Path(row["path"]) if row else None
        if where is None or not where.is_dir():
            raise ArtifactError(
                f"channel {channel}: refusing to roll back to {target[:12]}: the artifact is not "
                f"on disk ({where or 'no path registered'}); restore it there, or promote "
                "another artifact"
            )
        action = f"roll {channel} back to it"
        verify_artifact(where, mode=verify, expect_digest=target, action=action)
        with self._write() as db:
            now_target, current = rollback_step(db, channel, self.path)
            if now_target != target:
                raise UsageError(
                    f"channel {channel}: it changed while {target[:12]} was being verified; "
                    "run `kiln rollback` again"
                )
            db.execute(
                "UPDATE channels SET current_digest = ?, updated_at = ? WHERE name = ?",
                (target, _now(), channel),
            )
            return self._event(db, channel, target, current, "rollback", reason, actor)

    @staticmethod
    def _event(
        db: sqlite3.Connection,
        channel: str,
        digest: str,
        previous: str | None,
        action: str,
        reason: str,
        actor: str,
    ) -> dict[str, Any]:
        event = {
            "channel": channel,
            "digest": digest,
            "previous_digest": previous,
            "action": action,
            "reason": reason,
            "actor": actor,
            "created_at": _now(),
        }
        db.execute(
            "INSERT INTO promotion_events (channel, digest, previous_digest, action, reason, "
            "actor, created_at) VALUES (:channel, :digest, :previous_digest, :action, :reason, "
            ":actor, :created_at)",
            event,
        )
        return event


def _channel_state(row: sqlite3.Row) -> ChannelState:
    return ChannelState(
        name=row["name"],
        baseline_rule=row["baseline_rule"],
        baseline_digest=row["baseline_digest"],
        current_digest=row["current_digest"],
        current_name=row["current_name"],
        current_path=row["current_path"],
        updated_at=row["updated_at"],
    )
