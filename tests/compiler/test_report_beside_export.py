"""The report and the TensorRT-LLM exports run at once (compiler/pipeline.py running_beside):
the exports in a thread beside the report, each error raised only once both have ended."""

from __future__ import annotations

import threading
import time

import pytest

from kiln.compiler.pipeline import running_beside


def test_the_work_runs_while_the_block_runs() -> None:
    """Each waits for the other: run one after the other, neither would see the other."""
    entered, answered, heard = threading.Event(), threading.Event(), []

    def work() -> None:
        if entered.wait(10):  # the block has begun while the work runs
            answered.set()

    with running_beside(work, heard.append, ""):
        entered.set()
        assert answered.wait(10)
    assert heard == []


def test_the_blocks_error_waits_for_the_work_to_end() -> None:
    finished, heard = [], []
    go = threading.Event()

    def work() -> None:
        go.wait(60)
        time.sleep(0.2)
        finished.append(True)

    with pytest.raises(KeyError), running_beside(work, heard.append, "draft: "):
        go.set()
        raise KeyError("report failed")
    assert finished == [True]  # its stage was published before the error went on
    assert heard == ["draft: export: finishing the checkpoint being written before stopping"]


def test_the_works_error_is_raised_after_the_block() -> None:
    done = []

    def work() -> None:
        raise ValueError("export failed")

    with pytest.raises(ValueError, match="export failed"), running_beside(work, print, ""):
        time.sleep(0.1)
        done.append(True)
    assert done == [True]


def test_without_work_the_block_runs_alone() -> None:
    ran = []
    with running_beside(None, print, ""):
        ran.append(True)
    assert ran == [True]
