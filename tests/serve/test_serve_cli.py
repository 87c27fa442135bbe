"""`kiln serve`: what it serves (artifact, HF directory, registry channel), the backend
choice, TensorRT-LLM engines refused with built-for vs found, and a real process that
drains in-flight requests on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.serving import (
    SERVE_CPU_BATCHED_TOKENS,
    choose_backend,
    parse_size,
    resolve_model,
    serve_budget,
)
from kiln.compiler.trtllm.build.host import BuildEnvironment, GpuInfo
from kiln.compiler.trtllm.build.stamp import ENGINE_STAMP
from kiln.gates.releases import Registry
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.traffic import read_traffic
from tests.gates.conftest import build_artifact
from tests.serve.conftest import free_socket, wait_ready

REPO = Path(__file__).resolve().parents[2]
BUILD = "trtllm-build --checkpoint_dir trtllm/tp1 --output_dir engines/h100-sxm/engine"


def test_sizes() -> None:
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(UsageError, match="2GiB"):
        parse_size("lots")


def test_serve_steps_in_smaller_budgets_on_cpu_unless_told() -> None:
    assert serve_budget("cpu", None) == SERVE_CPU_BATCHED_TOKENS == 512
    assert serve_budget("cpu", 1000) == 1000  # one decode per sequence still fits a step
    assert serve_budget("cuda:0", None) is None  # the engine's 2048


def test_a_step_budget_below_the_running_sequences_is_refused(tiny_llama: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(tiny_llama), "--max-num-batched-tokens", "32"])
    assert result.exit_code != 0
    assert "--max-num-batched-tokens 32 is below --max-num-seqs 64" in result.output
    result = runner.invoke(
        main, ["serve", str(tiny_llama), "--max-num-batched-tokens", "100", "--max-num-seqs", "200"]
    )
    assert "raise the budget or lower --max-num-seqs" in result.output


def _with_engine(artifact: Path, sm: str = "sm90", trt: str = "10.13.0") -> Path:
    """Give an artifact an engine directory stamped as built for `sm` with TensorRT `trt`."""
    engine = artifact / "engines" / "h100-sxm" / "engine"
    engine.mkdir(parents=True)
    cc = f"{sm[2:-1]}.{sm[-1]}"
    stamp = {"format": "kiln-engine/1", "sm": sm, "compute_capability": cc,
             "tensorrt_version": trt, "command": BUILD}  # fmt: skip
    (engine / ENGINE_STAMP).write_text(json.dumps(stamp))
    return artifact


def test_artifact_hf_dir_and_registry_channel(tiny_llama: Path, tmp_path: Path) -> None:
    artifact = build_artifact(tmp_path, name="tiny", model_dir=tiny_llama)
    served = resolve_model(str(artifact), None)
    assert (served.name, served.is_artifact, served.model_dir) == ("tiny", True, artifact / "model")
    assert resolve_model(str(tiny_llama), None).model_dir == tiny_llama.resolve()
    with pytest.raises(UsageError, match="not a kiln artifact"):
        resolve_model(str(tmp_path / "nothing"), None)
    registry = tmp_path / "registry.db"
    with pytest.raises(UsageError, match="serves nothing"):
        resolve_model("registry://prod", str(registry))
    with Registry(registry) as reg:
        verdict: dict[str, Any] = {
            "passed": True,
            "candidate": {"digest": served.digest, "kind": "artifact"},
            "baseline": {"digest": "float", "kind": "source", "spec": "float"},
        }
        reg.record_gate_run(verdict, artifact)
        reg.promote(artifact, "prod")
    from_channel = resolve_model("registry://prod", str(registry))
    assert from_channel.path == artifact.resolve() and from_channel.digest == served.digest


def test_engine_for_another_gpu_is_refused_with_the_rebuild_command(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = resolve_model(str(_with_engine(build_artifact(tmp_path, model_dir=tiny_llama))), None)
    l40s = BuildEnvironment("1.2.0", "10.13.0", "12.9", (GpuInfo("NVIDIA L40S", (8, 9)),))
    with pytest.raises(UsageError) as refused:
        choose_backend("trtllm", model, l40s)
    message = refused.value.message
    assert "engine built for sm90 with TensorRT 10.13.0" in message
    assert "this GPU is sm89" in message and BUILD in message
    other_trt = BuildEnvironment("1.2.0", "10.9.0", "12.9", (GpuInfo("NVIDIA H100", (9, 0)),))
    with pytest.raises(UsageError, match=r"this machine has TensorRT 10\.9\.0"):
        choose_backend("trtllm", model, other_trt)
    kind, engine_dir, why = choose_backend("auto", model, l40s)
    assert (kind, engine_dir) == ("native", None) and "sm89" in why
    assert choose_backend("native", model, l40s)[0] == "native"


def test_cli_refuses_trtllm_here_and_checks_options(tiny_llama: Path, tmp_path: Path) -> None:
    artifact = _with_engine(build_artifact(tmp_path, model_dir=tiny_llama))
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(artifact), "--backend", "trtllm"])
    assert result.exit_code == 2
    assert "built for sm90" in result.output and "--backend native" in result.output
    result = runner.invoke(main, ["serve", str(tiny_llama), "--mirror", str(tiny_llama)])
    assert result.exit_code == 2 and "--mirror-log" in result.output
    result = runner.invoke(main, ["serve", str(tmp_path / "none")])
    assert result.exit_code == 2 and "not a kiln artifact" in result.output


def test_the_old_shadow_spellings_still_work_unlisted(tiny_llama: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(main, ["serve", str(tiny_llama), "--shadow", str(tiny_llama)])
    assert result.exit_code == 2 and "--mirror needs --mirror-log" in result.output
    old = ["--shadow", str(tiny_llama), "--shadow-log", str(tmp_path / "m.jsonl"),
           "--shadow-queue=4", "--shadow-fraction", "2"]  # fmt: skip
    result = runner.invoke(main, ["serve", str(tiny_llama), "--max-model-len", "64", *old])
    assert result.exit_code == 2 and "--mirror-fraction 2.0: must be in (0, 1]" in result.output
    assert "shadow" not in runner.invoke(main, ["serve", "--help"]).output


@pytest.mark.trtllm
def test_trtllm_backend_is_chosen_for_an_engine_built_for_this_gpu(tmp_path: Path) -> None:
    """Where TensorRT-LLM and an engine built for this GPU exist ($KILN_TRTLLM_ARTIFACT).
    Only the choice is checked: serving through TensorRT-LLM has never run (README, What runs
    where)."""
    pytest.importorskip("tensorrt_llm")
    spec = os.environ.get("KILN_TRTLLM_ARTIFACT")
    if not spec:
        pytest.skip("set KILN_TRTLLM_ARTIFACT to an artifact with an engine for this GPU")
    model = resolve_model(spec, None)
    kind, engine_dir, _ = choose_backend("trtllm", model)
    assert kind == "trtllm" and engine_dir is not None


def test_json_says_what_is_served_where(tiny_llama: Path) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kiln.compiler.cli", "serve", str(tiny_llama), "--json",
           "--port", str(port), "--max-model-len", "64", "--num-threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        served = json.loads(proc.stdout.readline())  # one line, before it serves
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=120)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert served["url"] == f"http://127.0.0.1:{port}/v1"
    assert (served["model"], served["backend"]) == (tiny_llama.name, "native")
    assert served["path"] == str(tiny_llama.resolve()) and served["digest"] is None


def test_sigterm_drains_in_flight_requests(tiny_llama: Path, tmp_path: Path) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    record = tmp_path / "traffic.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kiln.compiler.cli", "serve", str(tiny_llama), "--port", str(port),
           "--max-model-len", "512", "--num-threads", "1", "--record", str(record),
           "--served-model-name", "tiny", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout_s=120)
        frames: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "a b c", "max_tokens": 450, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        frames.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        at_signal = len(frames)
        reader.join(60)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        assert proc.stderr is not None and "step budget: 512 tokens" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert frames[-1] == "data: [DONE]"
    usage = json.loads(frames[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 450  # finished, not cut off
    assert at_signal < 450  # it was in flight when the signal came
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    [recorded] = read_traffic(record, allow_redacted=True)
    assert recorded.extra["usage"]["completion_tokens"] == 450
