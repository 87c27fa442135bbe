"""`kiln bench`: the report's math on known latencies, the Poisson schedule, and real runs
against kiln's own OpenAI-compatible server (the tiny model, uvicorn on 127.0.0.1)."""

from __future__ import annotations

import json
import socket
import statistics
from itertools import pairwise
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.runtime.base.errors import UsageError
from kiln.runtime.client.bench import file_requests, poisson_arrivals, run_bench, synthetic_requests
from kiln.runtime.client.bench_report import SLO, parse_slo, summarize
from kiln.runtime.client.http import OpenAIClient, StreamResult
from tests.serve.conftest import LiveServer


def timed(ttft: float, gaps: list[float], tokens: int | None = None) -> StreamResult:
    """A finished request sent at t=0 whose chunks arrive at ttft, then after each gap."""
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    count = tokens if tokens is not None else len(times)
    return StreamResult("x" * count, count, 10, 0.0, times, times[-1], "length")


def failed(message: str = "HTTP 400: prompt too long") -> StreamResult:
    return StreamResult(sent_at=0.0, finished_at=0.01, error=message)


# --- the math -------------------------------------------------------------------------------


def test_ttft_tpot_itl_follow_vllm_definitions() -> None:
    r = timed(0.1, [0.05, 0.05, 0.1])
    assert r.ttft_s == pytest.approx(0.1) and r.latency_s == pytest.approx(0.3)
    assert r.tpot_s == pytest.approx((0.3 - 0.1) / 3)
    assert r.itl_s == pytest.approx([0.05, 0.05, 0.1])
    # usage may report more tokens than chunks (a chunk can carry several): TPOT uses usage
    assert timed(0.1, [0.2], tokens=5).tpot_s == pytest.approx(0.2 / 4)
    assert timed(0.1, [], tokens=1).tpot_s is None


def test_percentiles_on_known_latencies() -> None:
    # 100 requests with TTFT 1, 2, ..., 100 ms and one token each
    results = [timed(ms / 1000, []) for ms in range(1, 101)]
    report = summarize(results, duration_s=2.0)
    assert report.ttft_ms is not None
    # numpy's linear interpolation over ranks 0..99
    assert report.ttft_ms.mean == pytest.approx(50.5)
    assert report.ttft_ms.p50 == pytest.approx(50.5)
    assert report.ttft_ms.p90 == pytest.approx(90.1)
    assert report.ttft_ms.p99 == pytest.approx(99.01)
    assert report.tpot_ms is None and report.itl_ms is None  # one token: no gaps
    assert report.request_throughput == pytest.approx(50.0)
    assert report.output_throughput == pytest.approx(50.0)


def test_goodput_counts_only_successful_requests_within_every_slo() -> None:
    results = [
        timed(0.1, [0.02] * 9),  # ttft 100 ms, tpot 20 ms: good
        timed(0.3, [0.02] * 9),  # ttft too slow
        timed(0.1, [0.06] * 9),  # tpot too slow
        timed(0.1, [], tokens=1),  # no TPOT to judge: good on TTFT alone
        failed(),
    ]
    slo = parse_slo("ttft_ms=200, tpot_ms=50")
    report = summarize(results, duration_s=4.0, slo=slo)
    assert report.good_requests == 2 and report.goodput == pytest.approx(0.5)
    assert report.completed == 4 and report.failed == 1
    assert report.errors == {"HTTP 400: prompt too long": 1}
    assert report.total_output_tokens == 10 + 10 + 10 + 1
    assert summarize(results, 4.0).goodput is None  # no SLO, no goodput
    assert summarize(results, 4.0, slo=SLO(e2el_ms=300)).good_requests == 2


def test_outputs_shorter_than_a_fixed_length_are_counted() -> None:
    results = [timed(0.1, [0.01] * 7), timed(0.1, [0.01] * 3)]  # 8 and 4 tokens
    report = summarize(results, 1.0, expected_output=[8, 8])
    assert report.short_outputs == 1


def test_slo_syntax_errors_name_the_item() -> None:
    assert parse_slo("e2el_ms=9000") == SLO(e2el_ms=9000.0)
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=fast", "tpot_ms=0"):
        with pytest.raises(UsageError, match="--slo"):
            parse_slo(bad)


def test_poisson_arrivals_have_exponential_gaps_at_the_rate() -> None:
    times = poisson_arrivals(4000, rate=20.0, seed=3)
    gaps = [b - a for a, b in pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 20, rel=0.06)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    # memoryless: about e^-1 of the gaps exceed the mean
    assert sum(g > mean for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)
    assert poisson_arrivals(50, 20.0, seed=3) == times[:50]  # seeded
    assert poisson_arrivals(3, float("inf")) == poisson_arrivals(3, None) == [0.0, 0.0, 0.0]
    with pytest.raises(UsageError):
        poisson_arrivals(3, 0.0)


# --- workloads ----------------------------------------------------------------------------


def test_synthetic_prompts_have_exact_token_lengths_with_a_tokenizer(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    requests = synthetic_requests(6, 20, 7, tokenizer_dir=tiny_llama, seed=1)
    prompts = [r.body["prompt"] for r in requests]
    assert len(set(prompts)) == 6  # distinct: no prefix-cache shortcut
    for r in requests:
        assert r.prompt_tokens == 20
        assert len(tokenizer(r.body["prompt"], add_special_tokens=False)["input_ids"]) == 20
        assert (r.body["max_tokens"], r.body["min_tokens"], r.body["ignore_eos"]) == (7, 7, True)
    words = synthetic_requests(2, 9, 3, chat=True, ignore_eos=False)
    assert len(words[0].body["messages"][0]["content"].split()) == 9
    assert "ignore_eos" not in words[0].body and words[0].endpoint == "/v1/chat/completions"


def test_prompts_from_traffic_and_text_files(tmp_path: Path) -> None:
    traffic = tmp_path / "traffic.jsonl"
    lines = [
        {"id": "a", "endpoint": "/v1/completions", "request": {"prompt": ["p", "q"]}},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    ]
    traffic.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    requests = file_requests(traffic)
    assert [r.endpoint for r in requests] == ["/v1/completions"] * 2 + ["/v1/chat/completions"]
    assert [r.body.get("prompt") for r in requests[:2]] == ["p", "q"]
    assert requests[2].body["max_tokens"] == 5 and "ignore_eos" not in requests[2].body
    fixed = file_requests(traffic, output_len=9)
    assert all(r.body["max_tokens"] == r.body["min_tokens"] == 9 for r in fixed)
    text = tmp_path / "prompts.txt"
    text.write_text("one prompt\n\nanother prompt\n")
    plain = file_requests(text, output_len=4, chat=True)
    assert [r.body["messages"][0]["content"] for r in plain] == ["one prompt", "another prompt"]
    with pytest.raises(UsageError, match="not found"):
        file_requests(tmp_path / "missing.txt")


# --- against kiln's server ----------------------------------------------------------------


@pytest.fixture(scope="module")
def kiln_server(shared_server: LiveServer) -> str:
    """kiln's server on the tiny model (tests/serve/conftest.py), by its base URL."""
    return shared_server.url


def test_fixed_concurrency_run_measures_every_request(kiln_server: str) -> None:
    requests = synthetic_requests(8, 16, 6, seed=2)
    report = run_bench(kiln_server, requests, concurrency=4, slo=SLO(ttft_ms=60_000))
    assert report.model == "tiny-llama"  # the first of /v1/models
    assert (report.completed, report.failed, report.short_outputs) == (8, 0, 0)
    assert report.total_output_tokens == 8 * 6  # ignore_eos held every answer to 6 tokens
    assert report.total_input_tokens > 0  # from the server's usage
    assert report.good_requests == 8
    assert report.ttft_ms and report.e2el_ms and report.tpot_ms and report.itl_ms
    assert 0 < report.ttft_ms.p50 <= report.e2el_ms.p50
    assert report.output_throughput == pytest.approx(48 / report.duration_s)


def test_poisson_run_and_errors_are_counted_not_fatal(kiln_server: str, tmp_path: Path) -> None:
    traffic = tmp_path / "traffic.jsonl"
    good = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0}
    bad = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 9.0}  # out of range
    traffic.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    requests = file_requests(traffic) * 3
    report = run_bench(kiln_server, requests, request_rate=50.0, seed=1)
    assert report.request_rate == 50.0 and report.concurrency is None
    assert (report.completed, report.failed) == (3, 3)
    [(message, count)] = report.errors.items()
    assert count == 3 and message.startswith("HTTP 400") and "temperature" in message


def test_client_streams_chat_with_per_token_times(kiln_server: str) -> None:
    client = OpenAIClient(kiln_server + "/v1/")
    client.model = client.first_model()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True}
    result = client.stream("/v1/chat/completions", body)
    client.close()
    assert result.ok and result.output_tokens == 5 and result.finish_reason == "length"
    assert result.prompt_tokens and len(result.token_times) >= 1
    assert result.token_times == sorted(result.token_times)
    assert result.ttft_s is not None and result.latency_s is not None
    assert 0 < result.ttft_s <= result.latency_s


def test_cli_writes_the_json_report(kiln_server: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench", kiln_server, "--num-requests", "4", "--concurrency", "2", "--input-len", "8",
        "--output-len", "3", "--slo", "ttft_ms=60000,tpot_ms=60000", "--json-file", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "TTFT (ms)" in result.output and "output throughput" in result.output
    report = json.loads(out.read_text())
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(report[metric]) == {"mean", "p50", "p90", "p99"}
    assert report["completed"] == 4 and report["total_output_tokens"] == 12
    assert report["slo"] == {"ttft_ms": 60000.0, "tpot_ms": 60000.0, "e2el_ms": None}
    assert report["good_requests"] == 4 and report["goodput"] > 0
    assert len(report["requests"]) == 4 and report["requests"][0]["output_tokens"] == 3
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert report[key] > 0


def test_cli_json_prints_the_report_as_one_document_on_stdout(kiln_server: str) -> None:
    args = ["bench", f"{kiln_server}/v1", "--num-requests", "2", "--input-len", "8",
            "--output-len", "2", "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the table went to stderr
    assert report["completed"] == 2 and report["total_output_tokens"] == 4
    assert "TTFT (ms)" in result.stderr


def test_cli_dead_url_is_a_usage_error(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # a port nobody listens on
    result = CliRunner().invoke(main, ["bench", f"http://127.0.0.1:{port}", "--num-requests", "1"])
    assert result.exit_code == 2
    assert "no server answers" in result.output and "kiln serve" in result.output
