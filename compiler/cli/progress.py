"""How `kiln compile` shows its progress messages (compiler/pipeline.py's `Progress`).

A message is a step ("quantize: W4A16 with llmcompressor", "loading ...") or, where it ends
in "(done/total)", a count of the current step's work ("subgraphs calibrated (3/33)", from
quant/backends/llmcompressor.py; quant/layer_report.py counts its layers and batches).

On a terminal each step is a row with its elapsed time, and a counted one a bar with its
count and an estimate of the time left. In a log (stderr not a terminal) each step is a line
of its own, "HH:MM:SS <step>" (tests/benchmarks/scale.py reads the stage from it), and
counts are written at most once every LOG_EVERY_S seconds, with the stage (the one the count
names, else the last step's), the elapsed time and the time left, so a long quantisation
leaves a trace without flooding the log.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

COUNTED = re.compile(r"^(?P<what>.*?) ?\((?P<done>\d+)/(?P<total>\d+)\)$")
# The stage a step belongs to, as tests/benchmarks/scale.py reads it from the log.
STAGES = r"(?:draft: )?(?:source|quantize|report|export|package|gate)"
STAGE = re.compile(rf"^{STAGES}\b")
# A count that names its stage ("report: quantised model batches run (3/8)"): one run beside
# another stage's steps (compiler/pipeline.py names the report's).
COUNT_STAGE = re.compile(rf"^(?P<stage>{STAGES}): ")
LOG_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class Count:
    """`done` of `total` units of `what` (e.g. "subgraphs calibrated")."""

    what: str
    done: int
    total: int
    stage: str = ""  # where the message names it


def count_of(message: str) -> Count | None:
    """The count a message ends with, or None for a step."""
    found = COUNTED.match(message)
    if found is None or int(found["total"]) <= 0:
        return None
    what, stage = found["what"], COUNT_STAGE.match(found["what"])
    if stage is not None:
        what = what[stage.end() :]
    done, total = int(found["done"]), int(found["total"])
    return Count(what, done, total, stage["stage"] if stage is not None else "")


def clock_time(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def wall_clock() -> str:
    """The time of day, as a log line starts with it."""
    return time.strftime("%H:%M:%S")


class StepLog:
    """Progress as lines for a log: every step, and counts at most once every `every_s`; each
    line starts with `stamp()`."""

    def __init__(
        self,
        write: Callable[[str], None],
        every_s: float = LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        stamp: Callable[[], str] = wall_clock,
    ) -> None:
        self.write, self.every_s, self.clock, self.stamp = write, every_s, clock, stamp
        self.stage = ""
        self.last = clock()  # when the last line was written
        self.counting: tuple[str, float, int] | None = None  # (what, since, done then)

    def __call__(self, message: str) -> None:
        now = self.clock()
        count = count_of(message)
        if count is None:
            if (found := STAGE.match(message)) is not None:
                self.stage = found.group(0)
            self.counting = None
            self.last = now
            self.write(f"{self.stamp()} {message}")
            return
        if self.counting is None or self.counting[0] != count.what:
            self.counting = (count.what, now, count.done)
        if now - self.last < self.every_s:
            return
        self.last = now
        _, since, first = self.counting
        left = ""
        if count.done > first:
            rate = (now - since) / (count.done - first)
            left = f", about {clock_time(rate * (count.total - count.done))} left"
        named = count.stage or self.stage
        stage = f"{named}: " if named else ""
        self.write(
            f"{self.stamp()} {stage}{count.what} {count.done}/{count.total}, "
            f"{clock_time(now - since)} elapsed{left}"
        )


class _OnlyCounted(ProgressColumn):
    """A column shown only on a row that counts its work."""

    def __init__(self, column: ProgressColumn) -> None:
        super().__init__()
        self.column = column

    def render(self, task: Task) -> Text:
        if not task.fields.get("counted"):
            return Text("")
        return self.column.render(task)  # type: ignore[return-value]


class StepBars:
    """Progress as rows of a rich Progress: one per step, with a bar where it counts."""

    def __init__(self, console: Console) -> None:
        # The step takes the room left, cut short rather than wrapped; the count names what
        # it counts where the row's description does not.
        step = Column(ratio=1, no_wrap=True, overflow="ellipsis")
        count = "{task.completed:.0f}/{task.total:.0f} {task.fields[label]}"
        self.bars = Progress(
            SpinnerColumn(finished_text="[green]✓[/]"),
            TextColumn("{task.description}", table_column=step),
            _OnlyCounted(BarColumn(bar_width=24)),
            _OnlyCounted(TextColumn(count, table_column=Column(no_wrap=True))),
            TimeElapsedColumn(),
            _OnlyCounted(TimeRemainingColumn()),
            console=console,
            transient=True,
            expand=True,
        )
        self.row: TaskID | None = None
        self.what: str | None = None  # what the current row counts
        self.total = 1

    def __call__(self, message: str) -> None:
        count = count_of(message)
        if count is None:
            self._start(message)
            return
        if self.row is None or (self.what is not None and self.what != count.what):
            self._start(f"  {count.what}")  # a second count within a step: a row of its own
        elif self.what is None:
            self.bars.update(self.row, label=count.what)  # the step's count, named by its bar
        assert self.row is not None
        self.what, self.total = count.what, count.total
        self.bars.update(self.row, total=count.total, completed=count.done, counted=True)

    def _start(self, description: str) -> None:
        self._finish()
        self.row = self.bars.add_task(description, total=None, counted=False, label="")
        self.what, self.total = None, 1

    def _finish(self) -> None:
        """The current row's step has ended (another began): shown done."""
        if self.row is None:
            return
        self.bars.update(self.row, total=self.total, completed=self.total)
        self.bars.stop_task(self.row)

    @contextmanager
    def shown(self) -> Iterator[StepBars]:
        with self.bars:
            yield self


@contextmanager
def step_progress(console: Console, log: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
    """The progress callback for a run: bars on `console` where it is a terminal, else lines
    through `log`."""
    if not console.is_terminal:
        yield StepLog(log)
        return
    with StepBars(console).shown() as bars:
        yield bars
