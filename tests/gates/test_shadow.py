"""The shadow comparison: two answers to each request, compared and summarised."""

from __future__ import annotations

from kiln.gates.decide.checks import shadow_checks
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.measure.shadow import compare_pair, is_valid_json, summarize_pairs
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import COMPLETIONS, TrafficRecord


def test_answers_are_compared_request_by_request() -> None:
    asks = [
        TrafficRecord("a", 0.0, COMPLETIONS, {"prompt": "Say hi"}),
        TrafficRecord("b", 0.0, COMPLETIONS, {"prompt": "Reply in JSON"}),
    ]
    base = [SideAnswer("hello", [1, 2]), SideAnswer('{"ok": 1}', [3, 4, 5])]
    cand = [SideAnswer("hello", [1, 2]), SideAnswer('{"ok": 2', [3, 4, 6])]
    pairs = [compare_pair(*answers) for answers in zip(asks, base, cand, strict=True)]
    report = summarize_pairs(pairs, base, cand, settings={"from": "test"}, worst=1)
    assert report.exact_match_rate == 0.5 and report.mean_prefix_tokens == 2.0
    assert report.num_json_requests == 1 and report.candidate_format_error_rate == 1.0
    assert [p.id for p in report.worst] == ["b"] and report.settings == {"from": "test"}
    failed = {c.name for c in shadow_checks(report, GatePolicy()) if not c.passed}
    assert failed == {"shadow: exact match", "shadow: format errors (candidate - baseline)"}


def test_json_validity_allows_one_code_fence() -> None:
    assert is_valid_json('{"a": 1}') and is_valid_json('```json\n{"a": 1}\n```')
    assert not is_valid_json("{'a': 1}") and not is_valid_json("sure! {}")


def test_exact_match_is_judged_beside_the_control_that_rounding_alone_diverges() -> None:
    asks = [TrafficRecord(i, 0.0, COMPLETIONS, {"prompt": f"Tell me {i}"}) for i in "abcd"]
    base = [SideAnswer(f"story {i} goes on", [1, 2, 3]) for i in "abcd"]
    cand = [*base[:2], SideAnswer("story c went", [1, 2, 4]), SideAnswer("story d", [1, 2])]
    pairs = [compare_pair(*answers) for answers in zip(asks, base, cand, strict=True)]
    report = summarize_pairs(pairs, base, cand)
    policy = GatePolicy()  # exact match >= 0.90
    report.control, report.control_exact_match_rate = "the baseline computed in float32", 0.25
    (exact, *_) = shadow_checks(report, policy)
    assert exact.passed and exact.threshold is None and exact.value == 0.5
    assert exact.detail.startswith("control (the baseline computed in float32) 25.0% < 90%")
    report.control_exact_match_rate = 1.0  # the control agrees: exact match is gated
    (exact, *_) = shadow_checks(report, policy)
    assert not exact.passed and exact.threshold == 0.9
    assert exact.detail == "control (the baseline computed in float32) 100.0%"
