"""`--record`: served requests become TrafficRecord lines; prompts and responses only when
the operator opts in; a sampling rate."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kiln.gates.measure.replay import ReplaySettings, replay_requests
from kiln.gates.measure.sides import HttpSide
from kiln.runtime.formats.traffic import TrafficError, read_traffic
from kiln.runtime.server.record import RecordSettings, TrafficRecorder, prompt_digest
from tests.serve.conftest import MODEL, ServerFactory

CHAT = [{"role": "user", "content": "Tell me a story"}]


def _traffic(url: str, ids: list[int]) -> list[dict]:
    """One completion, one chat, one token-id prompt, one streamed completion."""
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 4}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0}),
        ("/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0}),
        ("/v1/completions", {"prompt": "Streams", "max_tokens": 3, "stream": True}),
    ]
    answers = []
    for path, body in bodies:
        resp = httpx.post(url + path, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        answers.append(resp.json() if not body.get("stream") else {"stream": resp.text})
    return answers


def test_default_recording_keeps_settings_and_hashes_not_prompts(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "traffic.jsonl"
    server = start_server(recorder=TrafficRecorder(RecordSettings(path)))
    answers = _traffic(server.url, [5, 6, 7])
    with pytest.raises(TrafficError, match="record-prompts"):
        read_traffic(path)  # replay and calibration need the text
    records = read_traffic(path, allow_redacted=True)
    assert [r.endpoint for r in records] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/completions",
    ]
    first, chat = records[0], records[1]
    assert first.redacted and "prompt" not in first.request and first.response is None
    assert first.request["redacted"] == {
        "sha256": prompt_digest("Once upon"),
        "prompt_tokens": answers[0]["usage"]["prompt_tokens"],
    }
    assert first.request["max_tokens"] == 4 and first.request["model"] == MODEL
    assert first.extra["usage"] == answers[0]["usage"] and first.extra["latency_s"] > 0
    assert chat.request["redacted"]["sha256"] == prompt_digest(CHAT)
    assert "Tell me" not in path.read_text()


def test_opted_in_prompts_and_responses_replay_in_the_gate(
    start_server: ServerFactory, tmp_path: Path
) -> None:
    path = tmp_path / "traffic.jsonl"
    settings = RecordSettings(path, prompts=True, responses=True)
    server = start_server(recorder=TrafficRecorder(settings))
    answers = _traffic(server.url, [5, 6, 7])
    records = read_traffic(path)
    assert records[0].prompts() == ["Once upon"]
    assert records[0].response_texts() == [answers[0]["choices"][0]["text"]]
    assert records[1].request["messages"] == CHAT
    assert records[1].response_texts() == [answers[1]["choices"][0]["message"]["content"]]
    ids_record = records[2]  # token ids are stored as text, with the ids beside it
    assert ids_record.extra["prompt_token_ids"] == [5, 6, 7]
    assert isinstance(ids_record.request["prompt"], str)
    streamed = records[3]
    assert streamed.response is not None and "stream" not in streamed.request
    replayed = replay_requests(records, ReplaySettings(max_tokens=3))
    assert len(replayed) == 4
    side = HttpSide(server.url)  # the replay's endpoint side reads our SSE
    try:
        answers_again = [side.complete(r) for r in replayed]
    finally:
        side.close()
    assert all(a.error is None and a.ttft_s is not None for a in answers_again)
    assert answers_again[1].text == answers[1]["choices"][0]["message"]["content"]


def test_sample_rate(tmp_path: Path, start_server: ServerFactory) -> None:
    recorder = TrafficRecorder(RecordSettings(tmp_path / "t.jsonl", sample_rate=0.3), seed=1)
    draws = [recorder.sample() for _ in range(2000)]
    assert 0.25 < sum(draws) / len(draws) < 0.35
    path = tmp_path / "none.jsonl"
    server = start_server(recorder=TrafficRecorder(RecordSettings(path, sample_rate=0.0)))
    _traffic(server.url, [5, 6])
    assert not path.exists()


def test_bad_record_settings_are_usage_errors(tmp_path: Path) -> None:
    from kiln.runtime.base.errors import UsageError

    with pytest.raises(UsageError, match=r"\[0, 1\]"):
        RecordSettings(tmp_path / "t.jsonl", sample_rate=1.5)
    with pytest.raises(UsageError, match="does not exist"):
        RecordSettings(tmp_path / "missing" / "t.jsonl")
