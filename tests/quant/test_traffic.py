"""The recorded-traffic format shared by `kiln serve --record`, calibration and the shadow gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.runtime.formats.traffic import TrafficError, TrafficRecord, append_record, read_traffic


def _chat(i: int) -> TrafficRecord:
    return TrafficRecord(
        id=f"req-{i}",
        time=1_760_000_000.0 + i,
        endpoint="/v1/chat/completions",
        request={
            "messages": [{"role": "user", "content": f"q{i}"}],
            "max_tokens": 16,
            "temperature": 0.0,
        },
        response={"choices": [{"message": {"role": "assistant", "content": f"a{i}"}}]},
    )


def test_appended_records_read_back_equal(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    records = [_chat(i) for i in range(3)]
    for record in records:
        append_record(path, record)
    assert read_traffic(path) == records
    assert len(path.read_text().splitlines()) == 3


def test_bare_request_bodies_are_records(tmp_path: Path) -> None:
    path = tmp_path / "bodies.jsonl"
    path.write_text(
        json.dumps({"prompt": ["a", "b"], "max_tokens": 4})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
    )
    first, second = read_traffic(path)
    assert (first.id, first.endpoint, first.prompts()) == ("line-1", "/v1/completions", ["a", "b"])
    assert (second.id, second.is_chat, second.response_texts()) == ("line-3", True, [])


def test_unknown_fields_survive_a_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(
            {
                "id": "x",
                "time": 2.5,
                "endpoint": "/v1/completions",
                "request": {"prompt": "p"},
                "latency_ms": 12,
            }
        )
        + "\n"
    )
    [record] = read_traffic(path)
    assert record.extra == {"latency_ms": 12}
    assert record.to_dict()["latency_ms"] == 12 and "response" not in record.to_dict()


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"messages": []}', "non-empty list"),
        ('{"request": {"prompt": 3}}', "string or a list of strings"),
        ('{"endpoint": "/v1/embeddings", "request": {"input": "x"}}', "is not one of"),
        ('{"time": "noon", "request": {"prompt": "x"}}', "unix timestamp"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(TrafficError, match=says) as raised:
        read_traffic(path)
    assert raised.value.message.startswith(f"{path}:2: ")


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(TrafficError, match="traffic file not found"):
        read_traffic(tmp_path / "nope.jsonl")
