"""The report's float half in a process of its own, started before its job is known."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kiln.compiler.float_reference import start_process
from kiln.quant.reference import SAMPLES_FILE


def test_a_process_given_no_job_ends_and_leaves_nothing(tmp_path: Path) -> None:
    """Stopped while it imports (the compile found the float half cached, or failed): it
    ends at once, and so does one that finished importing and waits."""
    for wait_s in (0.0, 5.0):
        process = start_process()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and process.proc.poll() is None:
            time.sleep(0.2)  # importing, then waiting on stdin
        process.stop()
        assert process.proc.returncode is not None
        assert process.log.closed


def test_a_job_handed_later_gives_the_reference(tiny_llama: Path, tmp_path: Path) -> None:
    from kiln.quant.layer_report import REFERENCE_RECORD, report_samples

    samples = report_samples(tiny_llama, ["The licence grants permission to use the work."], 32)
    run = start_process().start(tiny_llama, samples, tmp_path, ".key-reference-")
    try:
        said: list[str] = []
        done = run.result(said.append)
        assert done == run.dir and said == []
        assert json.loads((done / SAMPLES_FILE).read_text()) == samples
        assert json.loads((done / REFERENCE_RECORD).read_text())["rows"] == len(samples[0]) - 1
    finally:
        run.stop()
    assert not run.dir.exists() and run.log.closed


def test_a_failed_reference_says_why(tmp_path: Path) -> None:
    """A job the process cannot do: the compile hears its exit and last line, and computes
    the float half in the report."""
    missing = tmp_path / "no-model"
    run = start_process().start(missing, [[1, 2, 3]], tmp_path, ".key-reference-")
    said: list[str] = []
    try:
        assert run.result(said.append) is None
    finally:
        run.stop()
    assert len(said) == 1 and "failed (exit 1:" in said[0]
    assert "the report computes them" in said[0]
    assert not run.dir.exists()


def test_a_job_for_a_process_that_ended_is_reported_not_raised(tmp_path: Path) -> None:
    """The process ended before its job was handed (killed): handing it raises nothing, and
    the result says it failed."""
    process = start_process()
    process.proc.kill()
    process.proc.wait()
    run = process.start(tmp_path / "model", [[1, 2]], tmp_path, ".key-reference-")
    said: list[str] = []
    try:
        assert run.result(said.append) is None
    finally:
        run.stop()
    assert said and "failed (exit" in said[0]


def test_a_folder_that_cannot_be_made_ends_the_process(tmp_path: Path) -> None:
    """The report stage's folder cannot be made (a file stands where it would be): the error
    is raised, and the process waiting for its job does not outlive it."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    process = start_process()
    with pytest.raises(OSError):
        process.start(tmp_path / "model", [[1, 2]], blocked / "report", ".key-reference-")
    assert process.proc.returncode is not None and process.log.closed
