"""The driver of a search on a Ray cluster: a loop over `ray.wait` that keeps the cluster's
room filled with the candidates wanted next, records each as it finishes, and cancels what
it started when it stops early or is interrupted."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from kiln.compiler.pipeline import link_tree
from kiln.compiler.search.cluster.connect import (
    ClusterSettings,
    alive,
    check_room,
    connected,
    describe,
    per_candidate,
    room,
)
from kiln.compiler.search.cluster.storage import check_storage, make_source_stage
from kiln.compiler.search.cluster.worker import attempts, attempts_file, judge_on_worker
from kiln.compiler.search.probes import next_probes, walk
from kiln.compiler.search.run import Search
from kiln.compiler.search.space import Candidate, mixed_candidate
from kiln.compiler.search.state import Judged
from kiln.compiler.stages import CACHE_DIR, StageResult, output_lock
from kiln.gates.releases import default_path, registry_path
from kiln.runtime.base.errors import UsageError

WAIT_S = 1.0  # how often the loop looks up from ray.wait (a signal is handled then)
CANCEL_WAIT_S = 30.0  # how long an interrupted driver waits for its cancelled tasks to end


def fan_out(settings: ClusterSettings) -> Callable[[Search, list[Candidate]], None]:
    """How run.py's `run_search` judges its candidates on the cluster `settings` names."""
    return partial(run_on_cluster, cluster=settings)


def run_on_cluster(search: Search, candidates: list[Candidate], cluster: ClusterSettings) -> None:
    """Judge `candidates`, then the mixed-precision ones, as tasks on the cluster."""
    with connected(cluster.address) as ray:
        need = per_candidate(ray, cluster)
        check_room(ray, cluster.address, need)
        spec = search.registry
        registry = (registry_path(spec) if spec else default_path()).resolve()
        search.load_state()
        search.start()
        try:
            check_storage(ray, search, registry, [n for n in alive(ray) if room(n, need)])
        except UsageError:
            search.undo()
            raise
        search.say("source: making the float source stage once, for every candidate")
        run = ClusterRun(ray, search, need, make_source_stage(search), str(registry))
        nodes = [describe(n) for n in alive(ray)]
        search.cluster = {"address": cluster.address, "per_candidate": need, "nodes": nodes,
                          "slots": run.slots()}  # fmt: skip
        with run.noting_signals():
            run.uniform(candidates)
            if search.settings.mixed:
                run.mixed()


class ClusterRun:
    """The candidates running on the cluster, and the loop that starts and records them."""

    def __init__(
        self, ray: Any, search: Search, need: dict[str, float], source: StageResult, registry: str
    ) -> None:
        self.ray, self.search, self.need = ray, search, need
        self.source, self.registry = source, registry
        self.task = ray.remote(judge_on_worker).options(
            num_cpus=need["CPU"], num_gpus=need["GPU"], max_retries=1
        )
        self.running: dict[Any, tuple[Judged, float]] = {}  # ref → (its row so far, started)
        self.phase = "uniform"
        self.shown = ""
        self.signalled: int | None = None  # SIGTERM or SIGINT, noted for the loop to act on

    @contextmanager
    def noting_signals(self) -> Iterator[None]:
        """While the candidates run, SIGTERM and SIGINT are noted, and the loop stops at its
        next look (within WAIT_S), cancelling its tasks: an exception raised by a handler
        inside `ray.wait` would reach the driver as Ray's own exit, status 1."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def note(signum: int, _frame: object) -> None:
            self.signalled = signum

        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def slots(self) -> int:
        """How many candidates the live nodes hold at once (nodes may join as it runs)."""
        return sum(room(n, self.need) for n in alive(self.ray))

    # ---- the phases ----------------------------------------------------------------------

    def uniform(self, candidates: list[Candidate]) -> None:
        """The uniform candidates, cheapest first, as many at once as there is room for."""
        self.search.restore_recipes()
        self.loop(
            lambda: [c for c in candidates if c.id not in self.search.judged],
            lambda cand, why: f"stopped before {cand.id}: {why}",
        )

    def mixed(self) -> None:
        """The probes of k, several at once: the k the serial search judges next first, then
        those it would judge after either outcome (search/probes.py)."""
        found = self.search.mixed_parent()
        if found is None:
            return
        parent, ranked = found
        top, judged = len(ranked) - 1, self.search.judged
        self.phase = "mixed"
        by_k = {k: mixed_candidate(parent.candidate, ranked, k) for k in range(1, top + 1)}
        lost: list[str] = []

        def passed() -> dict[int, bool]:
            return {k: judged[c.id].passed for k, c in by_k.items() if c.id in judged}

        def wanted() -> list[Candidate]:
            failed = [judged[c.id] for c in by_k.values() if c.id in judged and judged[c.id].failed]
            if failed and not lost:  # no verdict: the walk cannot go past it
                lost.append(f"mixed search stopped: {failed[0].candidate.id} has no verdict "
                            f"({failed[0].failed})")  # fmt: skip
                self.search.notes.append(lost[0])
            if lost:
                return []
            return [by_k[k] for k in next_probes(passed(), top, max(1, self.slots()))]

        def stopped(cand: Candidate, why: str) -> str:
            return f"mixed search stopped at k={cand.id.rsplit('keep', 1)[-1]}: {why}"

        ended = self.loop(wanted, stopped) is None and not lost
        if ended and walk(passed(), top).need is None:
            self.search.note_mixed_answer(parent, ranked, passed())

    # ---- the loop ------------------------------------------------------------------------

    def loop(
        self, wanted: Callable[[], list[Candidate]], stopped: Callable[[Candidate, str], str]
    ) -> str | None:
        """Keep the cluster busy with `wanted()` (asked again as each candidate finishes; in
        order of need) until nothing is wanted or running; a running candidate no longer
        wanted is cancelled. Returns why a budget stopped it starting more, if one did."""
        why: str | None = None
        try:
            while True:
                want = wanted()
                needed = {c.id for c in want}
                for ref, (row, _) in list(self.running.items()):
                    if row.candidate.id not in needed:
                        self.cancel(ref, "the mixed search had its answer without it")
                if why is None:
                    why = self.submit(want, stopped)
                if not self.running:
                    return why
                self.show(want)
                done, _ = self.ray.wait(list(self.running), num_returns=1, timeout=WAIT_S)
                if self.signalled == signal.SIGINT:
                    raise KeyboardInterrupt
                if self.signalled is not None:
                    raise SystemExit(128 + self.signalled)  # as a process ended by it
                for ref in done:
                    self.finish(ref)
        except BaseException:  # SIGTERM (SystemExit), Ctrl-C, or a failure of the driver
            self.cancel_all()
            raise

    def submit(self, want: list[Candidate], stopped: Callable[[Candidate, str], str]) -> str | None:
        """Start wanted candidates while the cluster has room; why not, when a budget stops it."""
        busy = {row.candidate.id for row, _ in self.running.values()}
        fresh = [c for c in want if c.id not in self.search.judged and c.id not in busy]
        free = self.slots() - len(self.running) if fresh else 0
        for cand in fresh[: max(0, free)]:
            if (why := self.over_budget()) is not None:
                self.search.notes.append(stopped(cand, why))
                return why
            self.start(cand)
        return None

    def start(self, cand: Candidate) -> None:
        search = self.search
        root = search.dir / "artifacts" / cand.id
        path = search.write_recipe(cand, output=root)
        row = Judged(cand, str(path), prices=search.prices(cand))
        self.seed(root)
        noted = attempts_file(search.dir, cand.id)
        noted.unlink(missing_ok=True)
        job = {"judged": row.to_dict(), "settings": asdict(search.settings),
               "registry": self.registry, "attempts": str(noted)}  # fmt: skip
        self.running[self.task.remote(job)] = (row, time.monotonic())
        search.say(f"{cand.id}: started on the cluster")

    def seed(self, root: Path) -> None:
        """Hard-link the float source stage into a candidate's own stage cache."""
        dest = root / CACHE_DIR / self.source.path.parent.name / self.source.path.name
        with output_lock(root):
            if not dest.is_dir():
                tmp = dest.parent / f".{dest.name}-{os.getpid()}.partial"  # swept if killed
                link_tree(self.source.path, tmp)
                os.replace(tmp, dest)

    def finish(self, ref: Any) -> None:
        """Record a finished candidate (a verdict, a refusal, or why it has none) and save."""
        row, submitted = self.running.pop(ref)
        cid = row.candidate.id
        row.seconds = time.monotonic() - submitted  # a failed row's; a judged one says its own
        errors = self.ray.exceptions
        try:
            row = Judged.from_dict(self.ray.get(ref))
        except errors.RayTaskError as exc:  # kiln itself failed there: no retry would help
            cause = getattr(exc, "cause", None) or exc
            text = " ".join(str(cause).split())[:400]
            self.failed(row, f"kiln failed on the worker: {type(cause).__name__}: {text}")
        except errors.RayError as exc:  # the worker or its node died, and died again
            self.failed(row, f"its worker died on both attempts ({type(exc).__name__})")
        attempts_file(self.search.dir, cid).unlink(missing_ok=True)
        self.search.judged[cid] = row
        self.search.save_state()
        outcome = (f"no verdict: {row.failed}" if row.failed else "refused" if row.refused
                   else "passed" if row.passed else "failed the gate")  # fmt: skip
        again = f", attempt {row.attempts}" if (row.attempts or 1) > 1 else ""
        self.search.say(f"{cid}: {outcome} (on {row.node}, {row.seconds:.0f} s{again})")

    def failed(self, row: Judged, why: str) -> None:
        """`row` with no verdict: why, and where its attempts ran."""
        tried = attempts(attempts_file(self.search.dir, row.candidate.id))
        row.failed, row.attempts = why, len(tried) or None
        if tried:
            row.node, row.started = tried[-1]["node"], tried[-1]["started"]

    def cancel(self, ref: Any, why: str) -> None:
        row, _ = self.running.pop(ref)
        self.ray.cancel(ref, force=True)
        attempts_file(self.search.dir, row.candidate.id).unlink(missing_ok=True)
        self.search.notes.append(f"{row.candidate.id} cancelled: {why}")

    def cancel_all(self) -> None:
        """Cancel every running candidate and wait for their workers to end."""
        refs = list(self.running)
        if not refs:
            return
        self.search.say(f"cancelling {len(refs)} running candidate(s) on the cluster")
        for ref in refs:
            self.ray.cancel(ref, force=True)
        self.ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)
        for row, _ in self.running.values():
            attempts_file(self.search.dir, row.candidate.id).unlink(missing_ok=True)
        self.running.clear()

    # ---- budget and progress -------------------------------------------------------------

    def durations(self) -> list[float]:
        """How long each candidate judged in this run took (those with a verdict)."""
        fresh = list(self.search.judged.values())[self.search.resumed :]
        return [j.seconds for j in fresh if j.failed is None]

    def over_budget(self) -> str | None:
        """Why no other candidate may start: --max-candidates (counting those running), or
        --budget-hours passed by a candidate of the mean length started now."""
        s, judged = self.search.settings, self.search.judged
        if s.max_candidates is not None and len(judged) + len(self.running) >= s.max_candidates:
            return f"--max-candidates {s.max_candidates} reached"
        seconds = self.durations()
        if s.budget_hours is not None and seconds:
            per = sum(seconds) / len(seconds)
            if time.monotonic() - self.search.started + per > s.budget_hours * 3600:
                return (f"--budget-hours {s.budget_hours} would be passed by the next "
                        f"candidate (~{per / 60:.1f} min each)")  # fmt: skip
        return None

    def show(self, want: list[Candidate]) -> None:
        """A progress line when what runs changes: running, finished, queued and the ETA."""
        busy = sorted(row.candidate.id for row, _ in self.running.values())
        queued = [c for c in want if c.id not in self.search.judged and c.id not in busy]
        finished = len(self.search.judged) - self.search.resumed
        line = (f"cluster, {self.phase}: {len(busy)} running ({', '.join(busy)}), {finished} "
                f"finished, {len(queued)} queued")  # fmt: skip
        if line == self.shown:
            return
        self.shown = line
        seconds = self.durations()
        if seconds:  # the mean candidate's length, over the cluster's room
            per, now = sum(seconds) / len(seconds), time.monotonic()
            left = len(queued) * per + sum(
                max(per - (now - t), 0) for _, t in self.running.values()
            )
            line += f", ETA ~{math.ceil(left / max(1, self.slots()) / 60)} min"
            line += " before mixed precision" if self.phase == "uniform" else ""
        self.search.say(line)
