"""The gate's calibration table: the default gate on good quantisation and planted damage.

    python tests/benchmarks/gate_table.py --work /tmp/kiln-gate-table [--rows control,W8A8]
        [--limit N] [--traffic recipes/traffic/sample.jsonl]

On the embedded SmolLM2-135M-Instruct: compiles W8A8 SmoothQuant, FP8 static, FP8 with an
FP8 KV cache and GPTQ W4A16 (kiln's own recipes below), builds the bf16-rounded control and
the three planted damages of `tests/gates/test_calibration.py` from them, gates each against
the unquantised model with the default `gates:` section (plus the same shadow traffic for
every row when --traffic is given) and prints one markdown row per candidate as it finishes
(with the tokens KL was measured over and the noise floor's KL), then the whole table. Each gate's
reports stay under WORK/reports/ROW/. Re-runs reuse the compiled artifacts (stage cache) and
the baseline's cached evaluation. Prints the machine it ran on; times are this machine's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from kiln.runtime.base.machine import describe_machine, machine_facts
from tests.gates.test_calibration import W8A8_RECIPE, calibration_candidates

_TAIL = """calibration: {dataset: builtin:licenses, num_samples: 32, max_seq_len: 128}
targets: [h100-sxm]
output: out
"""
SCHEMES = {
    "FP8 static": "quantization: {method: fp8, activations: fp8_static}\n",
    "FP8 + FP8 KV": "quantization: {method: fp8, activations: fp8_static, kv_cache: fp8}\n",
    "GPTQ W4A16": (
        "quantization: {method: gptq, weight_bits: 4, group_size: 64, "
        "ignore: [lm_head, 're:model\\.layers\\.(11|28)\\.mlp\\.down_proj$']}\n"
    ),
}
ORDER = [
    "control", "W8A8", "FP8 static", "FP8 + FP8 KV", "GPTQ W4A16",
    "o_proj ×1.5", "v_proj ×1.15", "down_proj swap",
]  # fmt: skip


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def compile_recipe(work: Path, name: str, text: str) -> Path:
    """Compile a recipe with `kiln compile --json`; returns the artifact's path."""
    recipe = work / f"{_slug(name)}.yaml"
    recipe.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "kiln.compiler.cli", "compile", str(recipe), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if run.returncode != 0:
        raise SystemExit(f"compile {name} failed:\n{run.stderr[-3000:]}")
    return Path(json.loads(run.stdout.strip().splitlines()[-1])["artifact"])


def _task_cell(verdict: GateVerdict, task: str) -> str:
    for t in verdict.tasks:
        if t.task == task:
            d = t.decision
            assert d.loss is not None and d.loss_lower is not None and d.loss_upper is not None
            return (
                f"{t.outcome}, {100 * d.loss:+.1f} [{100 * d.loss_lower:+.1f}, "
                f"{100 * d.loss_upper:+.1f}], {t.right_to_wrong}/{t.wrong_to_right}"
            )
    return "—"


def row(name: str, verdict: GateVerdict, tasks: list[str], seconds: float) -> str:
    """One markdown row: tasks, distribution checks, shadow, verdict and what failed."""
    cells = [name, *(_task_cell(verdict, t) for t in tasks)]
    ppl = verdict.perplexity[0].ratio if verdict.perplexity else None
    cells.append(f"{ppl:.3f}" if ppl is not None else "—")
    div = verdict.divergence
    cells.append(f"{div.kl_mean:.4f} / {div.top1_agreement:.1%}" if div else "—")
    cells.append(f"{div.num_tokens:,}" if div else "—")
    floor = verdict.noise_floor.divergence if verdict.noise_floor else None
    cells.append(f"{floor.kl_mean:.5f}" if floor else "—")
    shadow = verdict.shadow
    cells.append(f"{shadow.exact_match_rate:.0%}" if shadow else "—")
    failed = ", ".join(c.name for c in verdict.failed_checks)
    cells.append("**PASS**" if verdict.passed else f"**FAIL**: {failed}")
    cells.append(f"{seconds:.0f}")
    return "| " + " | ".join(cells) + " |"


def header(tasks: list[str]) -> str:
    names = [
        "candidate",
        *(f"{t} (outcome, loss pts [95% bounds], flips r→w/w→r)" for t in tasks),
        "ppl ratio",
        "KL mean / top-1",
        "KL tokens",
        "noise floor KL",
        "shadow exact",
        "verdict",
        "gate s",
    ]
    return "| " + " | ".join(names) + " |\n|" + "---|" * len(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-gate-table"))
    parser.add_argument("--rows", default=",".join(ORDER), help="comma-separated row names")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default all)")
    parser.add_argument("--traffic", default=None, help="recorded traffic for the shadow check")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ORDER))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; known: {', '.join(ORDER)}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    section: dict[str, Any] = {"limit": args.limit}
    if args.traffic:
        section["shadow"] = {"traffic": str(Path(args.traffic).resolve())}
    gates = load_gates(section, "gate_table")
    print(
        f"machine: {describe_machine(machine_facts())}; tasks {gates.tasks}, limit {gates.limit}",
        flush=True,
    )
    ref = sources.parse_source("builtin:smollm2-135m-instruct", base_dir=work)
    source = sources.materialize(ref, work / "sources")
    w8a8 = compile_recipe(work, "W8A8", W8A8_RECIPE)
    built = work / f"candidates-{time.strftime('%Y%m%d-%H%M%S')}"
    candidates = {n: art for n, (art, _) in calibration_candidates(source, w8a8, built).items()}
    model = W8A8_RECIPE[W8A8_RECIPE.index("model:") : W8A8_RECIPE.index("quantization:")]
    for name, quant in SCHEMES.items():
        if name in rows:
            recipe = f"name: smollm2-{_slug(name)}\n{model}{quant}{_TAIL}"
            candidates[name] = compile_recipe(work, name, recipe)
    lines = []
    task_names = [t for t in gates.tasks if t != "kiln_ppl"]
    print(header(task_names), flush=True)
    for name in [r for r in ORDER if r in rows]:
        began = time.perf_counter()
        out = work / "reports" / _slug(name)
        verdict = run_gate(str(candidates[name]), str(source), gates, out).verdict
        lines.append(row(name, verdict, task_names, time.perf_counter() - began))
        print(lines[-1], flush=True)
    print("\n" + header(task_names) + "\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
