"""Offline lm-eval tasks: load them from local YAML, run them, keep per-item scores.

Task YAML in `recipes/tasks/` loads its data with `custom_dataset: !function kiln_data.load`
(the JSONL beside the module), which stock lm-eval reads from any working directory. A user's
task directory may instead name its data as `${KILN_TASKS_DIR}/file.jsonl` (lm-eval passes
`data_files` to `datasets.load_dataset` as is, which resolves relative paths against the
working directory): task directories are gathered into a temporary one with that placeholder
replaced by the directory's absolute path, their Python helpers copied beside (`!function`
resolves next to the YAML) and their other files linked there.

Per-item scores come from lm-eval's logged samples (`log_samples=True`); the gate pairs
them by `doc_id` across the two sides.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.files import read_text

PLACEHOLDER = "${KILN_TASKS_DIR}"
# recipes/tasks of a source checkout (editable install); a packaged kiln passes tasks_dir.
BUILTIN_TASKS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "tasks"
PERPLEXITY_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")


@dataclass(slots=True)
class TaskResult:
    """One task on one side: aggregate metrics and per-item scores of its primary metric."""

    task: str
    output_type: str
    metric: str
    higher_is_better: bool
    value: float
    per_item: dict[int, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def is_perplexity(self) -> bool:
        return self.output_type == "loglikelihood_rolling"


def prepare_task_dir(sources: Sequence[Path], into: Path) -> Path:
    """Copy task YAML (placeholder resolved) and helpers from each source dir into `into`,
    and link its data files there (a helper reads them beside itself)."""
    into.mkdir(parents=True, exist_ok=True)
    for source in sources:
        source = source.resolve()
        if not source.is_dir():
            raise UsageError(f"{source}: task directory not found")
        for path in sorted(source.iterdir()):
            if path.suffix in (".yaml", ".yml"):
                text = read_text(path, what="task file").replace(PLACEHOLDER, str(source))
                (into / path.name).write_text(text)
            elif path.suffix == ".py":
                shutil.copy2(path, into / path.name)
            elif path.is_file() and not (into / path.name).exists():
                (into / path.name).symlink_to(path)
    return into


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads task names without resolving lm-eval's `!function` tags."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def local_task_names(task_dir: Path) -> set[str]:
    """Task names defined by the YAML files of a directory."""
    names = set()
    for path in task_dir.glob("*.y*ml"):
        try:
            data = yaml.load(read_text(path, what="task file"), Loader=_TaskYamlLoader)
        except yaml.YAMLError:
            continue
        if isinstance(data, dict) and isinstance(data.get("task"), str):
            names.add(data["task"])
    return names


def run_tasks(
    lm: Any,
    tasks: Sequence[str],
    task_dirs: Sequence[Path] = (BUILTIN_TASKS_DIR,),
    limit: int | None = None,
    num_fewshot: int | None = None,
) -> dict[str, TaskResult]:
    """Evaluate an lm-eval LM on tasks (local ones first); per-item scores kept."""
    results, _ = run_measurable_tasks(lm, tasks, task_dirs, limit, num_fewshot)
    return results


def run_measurable_tasks(
    lm: Any,
    tasks: Sequence[str],
    task_dirs: Sequence[Path] = (BUILTIN_TASKS_DIR,),
    limit: int | None = None,
    num_fewshot: int | None = None,
    unmeasurable: Callable[[str], str | None] | None = None,
) -> tuple[dict[str, TaskResult], dict[str, str]]:
    """`run_tasks`, except the tasks whose lm-eval output type `unmeasurable` gives a reason
    for: those are not run, and come back as {task: reason}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="kiln-tasks-") as tmp:
        task_dir = prepare_task_dir(task_dirs, Path(tmp) / "tasks")
        local = local_task_names(task_dir)
        # kiln_* names are ours: a typo fails at once, without indexing lm-eval's ~10k tasks.
        _check_known([t for t in tasks if t.startswith("kiln_")], local, task_dirs)
        manager = TaskManager(include_path=str(task_dir), include_defaults=bool(set(tasks) - local))
        _check_known(tasks, set(manager.all_tasks), task_dirs, local)
        # lm-eval logs every request at INFO; the gate prints its own progress.
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
        skipped: dict[str, str] = {}
        if unmeasurable is not None:
            kinds = output_types(manager, tasks)
            for name in tasks:
                why = next(filter(None, map(unmeasurable, kinds[name])), None)
                if why is not None:
                    skipped[name] = why
        wanted = [t for t in tasks if t not in skipped]
        output = None
        if wanted:
            output = lm_eval.simple_evaluate(
                model=lm,
                tasks=wanted,
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                bootstrap_iters=0,
                log_samples=True,
                verbosity="WARNING",
            )
            if output is None:
                raise UsageError("lm-eval returned no results (was this a non-zero rank?)")
    return ({name: _task_result(name, output) for name in wanted} if output else {}), skipped


def output_types(manager: Any, tasks: Sequence[str]) -> dict[str, set[str]]:
    """Each task's lm-eval output types (a group's: its leaf tasks')."""
    loaded = manager.load(list(tasks))
    leaves, groups = loaded["tasks"], loaded.get("group_map") or {}

    def kinds(name: str) -> set[str]:
        if name in leaves:
            return {str(leaves[name].OUTPUT_TYPE)}
        return set().union(*(kinds(child) for child in groups.get(name, [])))

    return {name: kinds(name) for name in tasks}


def task_problems(tasks: Sequence[str], task_dirs: Sequence[Path]) -> list[str]:
    """Problem lines for `tasks` no task file of `task_dirs` defines and, for a name that is
    not kiln's own (`kiln_*`), lm-eval's index neither."""
    local: set[str] = set()
    for directory in task_dirs:
        if not Path(directory).is_dir():
            return [f"task directory {directory} not found"]
        local |= local_task_names(Path(directory))
    missing = [t for t in tasks if t not in local]
    if any(not t.startswith("kiln_") for t in missing):
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:  # without lm-eval the gate cannot run anyway: it says so then
            missing = [t for t in missing if t.startswith("kiln_")]
        else:
            known = set(TaskManager(include_defaults=True).all_tasks)
            missing = [t for t in missing if t not in known]
    if not missing:
        return []
    names = ", ".join(sorted(local)) or "none"
    return [f"unknown task(s) {', '.join(missing)}: kiln's task files define {names} (in "
            f"{', '.join(map(str, task_dirs))}); lm-eval's own tasks are named as lm-eval "
            "names them"]  # fmt: skip


def _check_known(
    tasks: Sequence[str], known: set[str], task_dirs: Sequence[Path], local: set[str] | None = None
) -> None:
    missing = [t for t in tasks if t not in known]
    if missing:
        names = ", ".join(sorted(known if local is None else local)) or "none"
        raise UsageError(
            f"gates.tasks: unknown task(s) {', '.join(missing)}; local tasks are {names} "
            f"(from {', '.join(map(str, task_dirs))})"
        )


def _task_result(name: str, output: dict[str, Any]) -> TaskResult:
    config = output["configs"][name]
    output_type = config["output_type"]
    metrics = {
        key.split(",")[0]: float(value)
        for key, value in output["results"][name].items()
        if "," in key and "stderr" not in key and isinstance(value, (int, float))
    }
    if output_type == "loglikelihood_rolling":
        metric = "word_perplexity"
        return TaskResult(name, output_type, metric, False, metrics[metric], metrics=metrics)
    metric = config["metric_list"][0]["metric"] if config.get("metric_list") else "acc"
    per_item = {}
    for sample in output["samples"][name]:
        value = sample[metric]
        per_item[int(sample["doc_id"])] = float(value[0] if isinstance(value, list) else value)
    higher = bool(output.get("higher_is_better", {}).get(name, {}).get(metric, True))
    value = metrics.get(metric, math.nan)
    return TaskResult(name, output_type, metric, higher, value, per_item, metrics)
