"""The gate on vLLM-CPU beside the gate on kiln's runtime, and serving configurations that
damage answers with the same weights.

    PYTHONPATH=. python tests/benchmarks/gate_engines.py --work /tmp/kiln-gate-engines \
        [--rows float,W8A8,...] [--limit 200] [--kl-tokens 10240]

Sets up vLLM-CPU 0.32 in its own cached virtualenv (tests/benchmarks/comparators.py) and, on
the embedded SmolLM2-135M-Instruct, compiles a float artifact and kiln's W8A8 (SmoothQuant,
int8 dynamic), GPTQ W4A16 and FP8 static recipes. Each is gated against the unquantised model
with the default `gates:` section twice: in process on kiln's runtime (`--engine kiln`) and on
vLLM-CPU (`--engine vllm`, which also scores the candidate on kiln's runtime: the
engine-vs-runtime columns). Then the float artifact on vLLM-CPU under serving configurations
that damage answers (`--engine-arg`, the candidate's configuration; the baseline runs on
vLLM's defaults). A format vLLM-CPU does not load is a row saying so, with its log's last line.

Prints the machine, one markdown row per gate as it finishes, then the table. Reports stay
under WORK/reports/ROW-ENGINE/. Not part of `make test`: vLLM-CPU is a large install.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.measure.served import EngineError
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from kiln.runtime.base.machine import describe_machine, machine_facts
from tests.benchmarks.comparators import vllm_cpu_env
from tests.benchmarks.gate_table import SCHEMES, _slug, compile_recipe

MODEL = "model:\n  source: builtin:smollm2-135m-instruct\n"
TAIL = """calibration: {dataset: builtin:licenses, num_samples: 32, max_seq_len: 128}
report: {num_samples: 4, max_seq_len: 128}
targets: [h100-sxm]
output: out
"""
QUANTISED = {
    "float": "quantization: {method: none}\n",
    "W8A8": (  # TensorRT-LLM runs INT8 SmoothQuant in engines only
        "quantization: {method: smoothquant, weight_bits: 8, activations: int8_dynamic}\n"
        "deploy: {trtllm_path: engine}\n"
    ),
    "GPTQ W4A16": SCHEMES["GPTQ W4A16"],
    "FP8 static": SCHEMES["FP8 static"],
}
# The float artifact on vLLM, served in ways that change its answers.
DAMAGE = {
    "float on --max-model-len 96": ["--max-model-len", "96"],
    "float on rope_theta 1000": ["--hf-overrides", '{"rope_theta": 1000.0}'],
    "float on an FP8 KV cache without scales": ["--kv-cache-dtype", "fp8"],
}
ROWS = [*QUANTISED, *DAMAGE]


def vllm_environment(threads: int) -> None:
    """vLLM-CPU's own Python for `--engine vllm`, and its CPU settings (one process, its
    OpenMP threads on the first cores, 1 GiB of KV cache)."""
    os.environ["KILN_VLLM_PYTHON"] = str(vllm_cpu_env())
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        VLLM_TARGET_DEVICE="cpu",
    )


def _tasks(verdict: GateVerdict) -> str:
    return "; ".join(
        f"{t.task} {t.outcome} {100 * (t.decision.loss or 0):+.1f} pt" for t in verdict.tasks
    )


def _engine_vs_runtime(verdict: GateVerdict) -> str:
    found = verdict.engine_vs_runtime
    if not found:
        return "—"
    parts = [f"{name} {t['items_changed']}/{t['items']}" for name, t in found["tasks"].items()]
    parts += [f"ppl ×{p['ratio']:.4f}" for p in found["perplexity"].values()]
    kl = found.get("divergence")
    if kl:
        parts.append(f"KL {kl['kl_mean']:.5f}, top-1 {kl['top1_agreement']:.1%}")
    return "; ".join(parts)


def row(name: str, engine: str, verdict: GateVerdict | None, seconds: float, why: str = "") -> str:
    if verdict is None:
        return f"| {name} | {engine} | not served: {why} | | | | | {seconds:.0f} |"
    ppl = f"{verdict.perplexity[0].ratio:.3f}" if verdict.perplexity else "—"
    div = verdict.divergence
    kl = f"{div.kl_mean:.4f} / {div.top1_agreement:.1%}" if div else "—"
    failed = ", ".join(c.name for c in verdict.failed_checks)
    outcome = "**PASS**" if verdict.passed else f"**FAIL**: {failed}"
    return (f"| {name} | {engine} | {outcome} | {ppl} | {kl} | {_tasks(verdict)} | "
            f"{_engine_vs_runtime(verdict)} | {seconds:.0f} |")  # fmt: skip


HEADER = (
    "| candidate | engine | verdict: failed checks | ppl ratio | KL mean / top-1 | tasks | "
    "engine vs kiln runtime (items changed, ppl, KL) | gate s |\n|" + "---|" * 8
)


def gate(art: Path, source: Path, section: dict[str, Any], out: Path) -> GateVerdict:
    return run_gate(str(art), str(source), load_gates(section, "gate_engines"), out).verdict


def root_cause(message: str) -> str:
    """The line of an engine's log tail that says why it stopped: its last `...Error: ...`
    line that is not a wrapper pointing elsewhere ("See root cause above")."""
    lines = [line.strip() for line in message.splitlines() if "Error: " in line]
    causes = [line for line in lines if "root cause above" not in line]
    return ((causes or lines or message.splitlines())[-1])[:300]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-gate-engines"))
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    parser.add_argument("--limit", type=int, default=200, help="items per task")
    parser.add_argument("--kl-tokens", type=int, default=None,
                        help="gates.divergence.tokens (default 10240)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    vllm_environment(args.threads)
    kl = f"; KL over {args.kl_tokens} tokens" if args.kl_tokens else ""
    print(f"machine: {describe_machine(machine_facts())}; limit {args.limit}{kl}", flush=True)
    ref = sources.parse_source("builtin:smollm2-135m-instruct", base_dir=work)
    source = sources.materialize(ref, work / "sources")
    wanted = {r if r in QUANTISED else "float" for r in rows}
    artifacts = {
        name: compile_recipe(work, name, f"name: smollm2-{_slug(name)}\n{MODEL}{quant}{TAIL}")
        for name, quant in QUANTISED.items()
        if name in wanted
    }
    base: dict[str, Any] = {"limit": args.limit}
    if args.kl_tokens:
        base["divergence"] = {"tokens": args.kl_tokens}
    plan: list[tuple[str, str, Path, dict[str, Any]]] = []
    for name in rows:
        if name in QUANTISED:
            plan.append((name, "kiln", artifacts[name], base))
            plan.append((name, "vllm", artifacts[name], {**base, "engine": "vllm"}))
        else:
            section = {**base, "engine": "vllm", "engine_args": DAMAGE[name]}
            plan.append((name, "vllm", artifacts["float"], section))
    print(HEADER, flush=True)
    lines = []
    for name, engine, art, section in plan:
        began = time.perf_counter()
        out = work / "reports" / f"{_slug(name)}-{engine}"
        try:
            verdict: GateVerdict | None = gate(art, source, section, out)
            why = ""
        except EngineError as exc:
            verdict, why = None, root_cause(exc.message)
        lines.append(row(name, engine, verdict, time.perf_counter() - began, why))
        print(lines[-1], flush=True)
    print("\n" + HEADER + "\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
