"""The gate on a serving engine (gates/on_engine.py, gates/measure/served.py): kiln's own
`kiln serve` evaluated over HTTP scores items exactly as the runtime does in process, a
started engine is stopped with nothing left, a check a server cannot answer is named as not
measured and fails the gate, and an engine that will not start says why and where its log is.
vLLM and TensorRT-LLM runs are in tests/benchmarks/gate_engines.py (large installs)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.trtllm.rules.serve_options import check_serve_options
from kiln.gates.measure.http_lm import HttpLM
from kiln.gates.measure.lm_eval_adapter import KilnLM
from kiln.gates.measure.served import (
    Capabilities,
    EngineChoice,
    EngineError,
    ServeSettings,
    parse_engine,
    serve_side,
    trtllm_capabilities,
    trtllm_command,
    vllm_command,
)
from kiln.gates.measure.sides import resolve_side
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.trtllm_serve import draft_target, options_for_version
from kiln.runtime.server import NativeBackend, ServerConfig, create_app
from tests.serve.conftest import LiveServer, tiny_engine

GATES: dict[str, Any] = {
    "tasks": ["kiln_ppl", "kiln_mc", "kiln_qa"],
    "limit": 8,
    "divergence": {"num_texts": 2, "max_seq_len": 32, "top_k": 10},
}
TEXT = "Permission is hereby granted, free of charge, to any person obtaining a copy"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


class _Request:
    def __init__(self, *args: Any) -> None:
        self.args = args


def test_kiln_serve_over_http_scores_items_as_the_runtime_does_in_process(
    tiny_llama: Path, tmp_path: Path
) -> None:
    local = KilnLM(engine=tiny_engine(tiny_llama), max_length=120)
    server = LiveServer(create_app(NativeBackend(tiny_engine(tiny_llama)),
                                   ServerConfig("tiny", max_running=4))).start()  # fmt: skip
    try:
        with serve_side(parse_engine(server.url, model="tiny"), resolve_side(str(tiny_llama)),
                        ServeSettings(None, None, 5), tmp_path, "candidate",
                        local.tok_encode(TEXT)) as served:  # fmt: skip
            assert served.capabilities.prompt_logprobs and served.capabilities.echo_logprobs
            remote = HttpLM(served, local.tokenizer, max_length=120)
            pairs = [_Request(TEXT[:30], TEXT[30:50]), _Request("The", " capital of"),
                     _Request("The", " end")]  # fmt: skip
            mine, theirs = local.loglikelihood(pairs), remote.loglikelihood(pairs)
            for (a, greedy_a), (b, greedy_b) in zip(mine, theirs, strict=True):
                assert abs(a - b) < 1e-4 and greedy_a == greedy_b
            rolling = [_Request(TEXT)]
            assert abs(local.loglikelihood_rolling(rolling)[0]
                       - remote.loglikelihood_rolling(rolling)[0]) < 1e-4  # fmt: skip
            asks = [_Request(TEXT[:40], {"until": ["\n"], "max_gen_toks": 8})]
            assert local.generate_until(asks) == remote.generate_until(asks)
            ids = [local.tok_encode(TEXT)]
            for a_row, b_row in zip(local.topk_logprobs(ids, 5)[0],
                                    remote.topk_logprobs(ids, 5)[0], strict=True):  # fmt: skip
                assert a_row.keys() == b_row.keys()
                assert all(abs(a_row[t] - b_row[t]) < 1e-4 for t in a_row)
            remote.close()
    finally:
        server.stop()


def _gone(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return True
    return False


def test_a_gate_on_kiln_serve_starts_and_stops_it_and_scores_as_the_runtime(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    # --engine-arg is the candidate's serving configuration; the baseline runs on defaults.
    gates = load_gates({**GATES, "engine": "kiln-serve", "engine_args": ["--max-num-seqs=3"]},
                       "test")  # fmt: skip
    outcome = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out")
    verdict = outcome.verdict
    engines = verdict.engines
    assert engines["candidate"]["command"][-1] == "--max-num-seqs=3"
    assert "--max-num-seqs=3" not in engines["baseline"]["command"]
    for role in ("candidate", "baseline"):
        record = engines[role]
        assert record["engine"] == "kiln-serve" and "serve" in record["command"]
        assert record["capabilities"]["prompt_logprobs"] is True
        assert Path(record["log"]).is_file()
        assert _gone(record["url"]), f"the {role}'s server is still up"
    assert _serving(noisy_artifact) == [] and _serving(tiny_llama) == []
    assert engines["machine"]["cores"] == os.cpu_count()
    assert not [c for c in verdict.checks if c.outcome == "not measured"]
    assert {t.task for t in verdict.tasks} == {"kiln_mc", "kiln_qa"}
    assert [p.task for p in verdict.perplexity] == ["kiln_ppl"]
    # kiln serve is kiln's runtime: the engine changes no item and no distribution.
    same = verdict.engine_vs_runtime
    assert same is not None
    assert all(t["items_changed"] == 0 for t in same["tasks"].values())
    assert abs(same["perplexity"]["kiln_ppl"]["ratio"] - 1) < 1e-4
    assert same["divergence"]["kl_mean"] < 1e-6
    report = (tmp_path / "out" / "gate.md").read_text()
    assert "engine (candidate): kiln-serve" in report and "Engine vs kiln's runtime" in report
    stored = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert stored["engines"]["candidate"]["command"] == engines["candidate"]["command"]


def test_checks_a_server_cannot_answer_are_not_measured_and_fail_the_gate(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, openai_stub
) -> None:
    """A server with completions but no log-probabilities (TensorRT-LLM 1.2's): generation
    tasks are measured on it, loglikelihood tasks and the KL are named as not measured."""
    stub = openai_stub(lambda body: "Paris")
    gates = load_gates({**GATES, "engine": stub.url, "engine_model": "stub-model"}, "test")
    outcome = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out")
    verdict = outcome.verdict
    assert not verdict.passed
    missing = {c.name: c for c in verdict.checks if c.outcome == "not measured"}
    assert set(missing) == {"kiln_ppl: not measured", "kiln_mc: not measured",
                            "KL divergence: not measured"}  # fmt: skip
    assert all(not c.passed for c in missing.values())
    assert "returns no prompt log-probabilities" in missing["kiln_mc: not measured"].detail
    assert [t.task for t in verdict.tasks] == ["kiln_qa"]  # measured on the stub
    assert any("the baseline in process" in n for n in verdict.notes)
    assert "⛔ not measured" in (tmp_path / "out" / "gate.md").read_text()


def _serving(path: Path) -> list[str]:
    """Processes whose command line serves `path` (none should outlive a gate)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(path).encode() in argv:
            found.append(proc.name)
    return found


def test_an_engine_that_will_not_start_names_its_log(noisy_artifact: Path, tmp_path: Path) -> None:
    side = resolve_side(str(noisy_artifact))
    choice = parse_engine("kiln-serve", ["--no-such-option"])
    serving = serve_side(choice, side, ServeSettings(None, None, 5), tmp_path, "candidate", [1])
    with pytest.raises(EngineError, match="exited 2 before it answered /health") as raised:
        serving.__enter__()
    assert str(tmp_path / "candidate-kiln-serve.log") in raised.value.message
    assert "No such option" in raised.value.message
    assert _serving(noisy_artifact) == []


def test_sigterm_to_kiln_stops_the_engine_it_started(noisy_artifact: Path, tmp_path: Path) -> None:
    """A cancelled CI job sends SIGTERM: kiln exits through the engine's stop, so the engine
    (in its own session, which the signal does not reach) is not left serving."""
    side = resolve_side(str(noisy_artifact))
    choice = EngineChoice("kiln-serve")
    before = signal.getsignal(signal.SIGTERM)
    serving = serve_side(choice, side, ServeSettings(None, None, 5), tmp_path, "cand", [1])
    with pytest.raises(SystemExit) as raised, serving as s:
        assert _serving(noisy_artifact) != []
        os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.code == 128 + signal.SIGTERM
    assert _serving(noisy_artifact) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{s.url}/health", timeout=2)
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_engine_slower_than_its_timeout_is_stopped_and_named(
    noisy_artifact: Path, tmp_path: Path
) -> None:
    side = resolve_side(str(noisy_artifact))
    choice = EngineChoice("kiln-serve", timeout_s=0.2)
    serving = serve_side(choice, side, ServeSettings(None, None, 5), tmp_path, "candidate", [1])
    with pytest.raises(EngineError, match=r"did not answer .*/health within 0.2 s") as raised:
        serving.__enter__()
    assert (
        "gates.engine_timeout_s" in raised.value.message
        and "it was stopped" in raised.value.message
    )


def test_kiln_gate_takes_the_engine_on_its_command_line(noisy_artifact: Path, tmp_path: Path):
    result = CliRunner().invoke(main, ["gate", str(noisy_artifact), "--baseline",
                                       str(noisy_artifact), "--engine", "llama.cpp"])  # fmt: skip
    assert result.exit_code == 2
    assert "--engine 'llama.cpp': not an engine kiln can gate on" in result.output
    with pytest.raises(UsageError, match=r"gates\.engine: 'nope' is not one of kiln"):
        load_gates({"engine": "nope"}, "recipe.yaml")
    with pytest.raises(UsageError, match="runs in this process and takes no --engine-arg"):
        parse_engine("kiln", ["--x"])


def test_vllm_is_served_the_artifacts_context_and_kv_cache(noisy_artifact: Path, monkeypatch):
    monkeypatch.setenv("KILN_VLLM_PYTHON", "/opt/vllm/bin/python")
    side = resolve_side(str(noisy_artifact))
    argv, config = vllm_command(side, 8123, ServeSettings(4096, "fp8", 20))
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == str(noisy_artifact / "model")
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--max-logprobs") + 1] == "20"
    assert config["kv_cache_dtype"] == "fp8"
    _, int8 = vllm_command(side, 8123, ServeSettings(None, "int8", 20))
    assert "not a vLLM KV-cache dtype" in int8["kv_cache_dtype"]


def test_trtllm_options_are_spelled_for_the_installed_version(noisy_artifact: Path, tmp_path):
    options = {"speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 4}}
    assert options_for_version(options, "1.2.1") == options
    later = options_for_version(options, "1.3.0rc24")
    assert later["speculative_config"] == {"decoding_type": "Draft_Target", "max_draft_len": 4}
    ngram = {"speculative_config": {"decoding_type": "NGram"}}
    assert options_for_version(ngram, "1.3.0") == ngram
    assert (draft_target(None), draft_target("1.2.1"), draft_target("1.3.0rc20")) == (
        "DraftTarget", "DraftTarget", "Draft_Target")  # fmt: skip
    spelled_later = {"decoding_type": "Draft_Target", "max_draft_len": 4,
                     "speculative_model_dir": "draft/model"}  # fmt: skip
    assert check_serve_options({"speculative_config": spelled_later}) == []
    answered = Capabilities(True, True)
    assert trtllm_capabilities(answered, "1.3.0") is answered
    old = trtllm_capabilities(answered, "1.2.1")
    assert not old.prompt_logprobs and not old.echo_logprobs
    assert "loglikelihood needs >= 1.3.0rc11" in (old.missing("scores") or "")
    side = resolve_side(str(noisy_artifact))
    with pytest.raises(UsageError, match="TensorRT-LLM is not installed here"):
        trtllm_command(side, 8123, ServeSettings(None, None, 20), None, tmp_path)
