"""The mirror: mirrored requests logged with both answers, judged by `kiln gate --mirror-log`;
a saturated candidate drops requests instead of slowing the primary."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.runtime import SamplingParams
from kiln.runtime.formats.artifact import load_manifest
from kiln.runtime.formats.mirror_log import MirrorEntry, read_mirror_log
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.server.mirror import Mirror, MirrorJob
from tests.gates.conftest import build_artifact
from tests.serve.conftest import MODEL, ServerFactory, tiny_engine

PROMPTS = ["The quick brown fox", "Licensed under the Apache License", "Answer in JSON:"]


def _perturbed(model_dir: Path, into: Path) -> Path:
    """A copy of the model with noise on every weight: a candidate that answers differently."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, into)
    for path in into.glob("*.safetensors"):
        generator = torch.Generator().manual_seed(0)
        tensors = load_file(path)
        noisy = {k: t + 0.5 * t.std() * torch.randn(t.shape, generator=generator)
                 for k, t in tensors.items()}  # fmt: skip
        save_file(noisy, path, metadata={"format": "pt"})
    return into


@pytest.fixture(scope="module")
def artifacts(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    other = _perturbed(tiny_llama, root / "noisy-model")
    return {
        "primary": build_artifact(root / "a", name="primary", model_dir=tiny_llama),
        "same": build_artifact(root / "b", name="same-weights", model_dir=tiny_llama),
        "other": build_artifact(root / "c", name="other-model", model_dir=other),
    }


def _mirrored(start_server: ServerFactory, primary: Path, candidate: Path, log: Path) -> Path:
    from kiln.runtime import Engine

    manifest = load_manifest(candidate)
    mirror = Mirror(
        Engine.from_artifact(candidate, max_model_len=128, num_threads=1),
        log,
        fraction=1.0,
        model=manifest.name,
        digest=manifest.digest,
    )
    server = start_server(
        tiny_engine(primary / "model"),
        {"store_prompts": True},
        mirror=mirror,
        digest=load_manifest(primary).digest,
    )
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "temperature": 0}  # fmt: skip
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 200
    deadline = time.monotonic() + 60
    while mirror.completed < len(PROMPTS) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mirror.completed == len(PROMPTS) + 1 and mirror.dropped == 0
    return log


def _gate(candidate: Path, baseline: Path, log: Path, out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        ["gate", str(candidate), "--baseline", str(baseline), "--mirror-log", str(log),
         "--no-record", "--out", str(out), "--json"],
    )  # fmt: skip
    return result.exit_code, result.output


def test_same_weights_candidate_passes_the_gate(
    start_server: ServerFactory, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    log = _mirrored(start_server, artifacts["primary"], artifacts["same"], tmp_path / "s.jsonl")
    entries = read_mirror_log(log)
    assert [e.prompt for e in entries[:3]] == PROMPTS
    assert entries[3].endpoint == "/v1/chat/completions"
    for e in entries:
        assert e.candidate.text == e.primary.text and e.candidate.token_ids == e.primary.token_ids
        assert e.primary.ttft_s is not None and e.candidate.ttft_s is not None
        assert e.candidate.digest == load_manifest(artifacts["same"]).digest
    code, output = _gate(artifacts["same"], artifacts["primary"], log, tmp_path / "report")
    assert code == 0, output
    verdict = json.loads(output.splitlines()[-1])
    assert verdict["passed"] and verdict["shadow"]["exact_match_rate"] == 1.0
    assert verdict["shadow"]["num_requests"] == 4 and verdict["shadow"]["num_json_requests"] == 1


def test_a_different_model_fails_and_a_wrong_artifact_is_refused(
    start_server: ServerFactory, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    log = _mirrored(start_server, artifacts["primary"], artifacts["other"], tmp_path / "o.jsonl")
    code, output = _gate(artifacts["other"], artifacts["primary"], log, tmp_path / "report")
    assert code == 1, output
    verdict = json.loads(output.splitlines()[0])
    failed = [c["name"] for c in verdict["checks"] if not c["passed"]]
    assert "shadow: exact match" in failed and verdict["shadow"]["exact_match_rate"] < 0.9
    code, output = _gate(artifacts["same"], artifacts["primary"], log, tmp_path / "r2")
    assert code == 2 and "was mirrored with candidate other-model" in output


def test_redacted_prompts_by_default(
    start_server: ServerFactory, artifacts: dict[str, Path], tmp_path: Path
) -> None:
    from kiln.runtime import Engine

    log = tmp_path / "r.jsonl"
    mirror = Mirror(Engine.from_artifact(artifacts["same"], max_model_len=128), log, 1.0,
                          "same")  # fmt: skip
    server = start_server(mirror=mirror)
    body = {"prompt": "secret words", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    deadline = time.monotonic() + 30
    while mirror.completed < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    [entry] = read_mirror_log(log)
    assert entry.prompt.startswith("<redacted sha256:") and "secret" not in log.read_text()


def test_saturated_candidate_drops_without_blocking(tiny_llama: Path, tmp_path: Path) -> None:
    # Nothing drains the queue before start(): an offer that waited for room would never return.
    mirror = Mirror(tiny_engine(tiny_llama), tmp_path / "d.jsonl", 1.0, "c", max_queue=2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    accepted: list[bool] = []

    def offer_all() -> None:
        for i in range(30):
            entry = MirrorEntry(f"r{i}", time.time(), "/v1/completions", "p", {}, SideAnswer())
            accepted.append(mirror.offer(MirrorJob(entry, "a b c", None, params)))

    offering = threading.Thread(target=offer_all)
    offering.start()
    offering.join(timeout=60)
    assert not offering.is_alive()  # a full queue drops the job; the offer returns at once
    assert accepted == [True, True] + [False] * 28
    assert (mirror.offered, mirror.dropped) == (30, 28)
    mirror.start()
    mirror.shutdown()
    assert mirror.completed <= 2
