"""Replay against two real HTTP servers on 127.0.0.1 streaming SSE, and the shadow
comparison of their answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.gates.decide.checks import shadow_checks
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.measure.replay import ReplaySettings, replay, replay_requests
from kiln.gates.measure.sides import HttpSide
from kiln.runtime.formats.traffic import TrafficRecord, read_traffic
from tests.gates.conftest import OpenAIStub, answers_with, baseline_responder, write_traffic


def test_identical_sides_match_exactly(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    records = read_traffic(write_traffic(tmp_path / "traffic.jsonl"))
    base, cand = openai_stub(baseline_responder), openai_stub(baseline_responder)
    report = replay(records, HttpSide(base.url), HttpSide(cand.url))
    assert report.num_requests == 6
    assert report.exact_match_rate == 1.0 and report.worst == []
    assert report.length_ratio == 1.0 and report.median_first_divergence is None
    assert report.num_json_requests == 2
    assert report.baseline_format_error_rate == report.candidate_format_error_rate == 0.0
    assert all(c.passed for c in shadow_checks(report, GatePolicy()))


def test_replay_forces_greedy_and_identical_settings(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    records = read_traffic(write_traffic(tmp_path / "traffic.jsonl"))
    base, cand = openai_stub(baseline_responder), openai_stub(baseline_responder)
    replay(records, HttpSide(base.url + "/v1"), HttpSide(cand.url), ReplaySettings(max_tokens=12))
    assert base.requests == cand.requests
    for body in base.requests:
        assert body["temperature"] == 0.0 and body["max_tokens"] == 12
        assert body["stream"] is True and body["model"] == "stub-model"


def test_diverging_answers_are_measured(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    records = read_traffic(write_traffic(tmp_path / "traffic.jsonl"))
    changed = answers_with(
        {
            "Once upon a time": "there was a small dragon",  # diverges at char 18
            "Give me a user record.": "user: ada, id: 7",  # JSON broken
            "Count: one two": "three four five six seven eight",  # longer
        }
    )
    base, cand = openai_stub(baseline_responder, 0.002), openai_stub(changed, 0.002)
    report = replay(records, HttpSide(base.url), HttpSide(cand.url), ReplaySettings(worst=2))
    assert report.exact_match_rate == pytest.approx(3 / 6)
    assert report.candidate_format_error_rate == 0.5 and report.baseline_format_error_rate == 0
    base_chars = sum(
        len(a)
        for a in (
            "jumps over the lazy dog",
            "Blue is a colour",
            '{"name": "Ada"}',
            '{"user": "ada", "id": 7}',
            "there was a small village by the sea",
            "three four five",
        )
    )
    cand_chars = (
        base_chars
        - len("village by the sea")
        + len("dragon")
        - len('{"user": "ada", "id": 7}')
        + len("user: ada, id: 7")
        + len(" six seven eight")
    )
    assert report.length_ratio == pytest.approx(cand_chars / base_chars)
    # first divergences: 18 ("there was a small "), 0 (JSON), 15 (after "three four five")
    assert report.median_first_divergence == 15
    # least shared prefix first: r4 0/24, r6 15/31, then r5 18/36 (kept out by worst=2)
    assert [p.id for p in report.worst] == ["r4", "r6"]
    assert report.worst[0].prefix_chars == 0 and report.mean_prefix_tokens is None
    lat = report.candidate_latency
    assert lat.ttft_p50 is not None and lat.ttft_p50 > 0 and lat.tpot_p50 is not None
    failed = {c.name for c in shadow_checks(report, GatePolicy()) if not c.passed}
    assert failed == {"shadow: exact match", "shadow: format errors (candidate - baseline)"}


def test_transport_errors_are_counted_not_raised(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    records = read_traffic(write_traffic(tmp_path / "traffic.jsonl"))
    base = openai_stub(baseline_responder)
    broken = openai_stub(answers_with({"Count: one two": "!500"}))
    report = replay(records, HttpSide(base.url), HttpSide(broken.url))
    assert report.candidate_error_rate == pytest.approx(1 / 6)
    assert report.baseline_error_rate == 0
    dead = replay(records[:1], HttpSide(base.url), HttpSide("http://127.0.0.1:9"))
    assert dead.candidate_error_rate == 1.0 and dead.exact_match_rate == 0.0
    failed = {c.name for c in shadow_checks(report, GatePolicy()) if not c.passed}
    assert "shadow: candidate error rate" in failed


def test_a_batched_prompt_list_is_replayed_one_prompt_at_a_time() -> None:
    record = TrafficRecord("b", 0.0, "/v1/completions", {"prompt": ["a", "b"], "n": 3})
    split = replay_requests([record], ReplaySettings())
    # no limit named: both sides get the same explicit one instead of their own defaults
    assert all(r.request["max_tokens"] == 64 for r in split)
    assert [(r.id, r.request["prompt"], r.request["n"]) for r in split] == [
        ("b#0", "a", 1),
        ("b#1", "b", 1),
    ]
