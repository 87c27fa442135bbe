"""kiln's task files are lm-eval's: stock lm-eval reads them from any working directory, and
kiln's lm-eval entry point keeps lm-eval's own models beside `kiln`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "recipes" / "tasks"
NAMES = ("kiln_cloze", "kiln_mc", "kiln_next_word", "kiln_ppl", "kiln_qa")


@pytest.mark.parametrize("name", NAMES)
def test_stock_lm_eval_loads_each_task_from_elsewhere(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)  # data paths must not depend on the working directory
    task = TaskManager(include_path=str(TASKS), include_defaults=False).load_task_or_group([name])[
        name
    ]
    data = "kiln_cloze.jsonl" if name == "kiln_next_word" else f"{name}.jsonl"
    lines = (TASKS / data).read_text().splitlines()
    docs = list(task.test_docs())
    assert len(docs) == len([line for line in lines if line.strip()])


def test_the_kiln_entry_point_keeps_lm_evals_own_models(tmp_path: Path) -> None:
    code = (
        "import kiln.gates.measure.lm_eval_adapter\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('hf').__name__, get_model('kiln').__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=dict(os.environ), check=True)  # fmt: skip
    assert out.stdout.split() == ["HFLM", "KilnLM"]
