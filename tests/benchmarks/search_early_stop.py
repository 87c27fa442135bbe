"""What the early look of `kiln search` saves: the same search with and without it.

    PYTHONPATH=. python tests/benchmarks/search_early_stop.py RECIPE [-- kiln search options]

e.g. `... recipes/demo-gated.yaml -- --target h100-sxm --schemes fp8,w8a16,w4a16 --kv-cache
none`. Runs `kiln search` twice in fresh directories of its own (one registry, gate cache
and per-user cache each, so nothing measured in one run is reused by the other): with the
early look, then with `--no-early-stop`. Prints
the machine, each run's wall time, the candidates the early look failed without a full gate,
whether both runs chose the same winner, and the ratio of the two wall times measured here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.runtime.base.machine import describe_machine, machine_facts


def run(recipe: str, options: list[str], root: Path, early: bool) -> tuple[float, dict]:
    out = root / ("early" if early else "full")
    argv = [
        sys.executable,
        "-m",
        "kiln.compiler.cli.main",
        "search",
        recipe,
        "--json",
        "--output",
        str(out),
        "--registry",
        str(out.with_suffix(".db")),
        *options,
    ]
    if not early:
        argv.append("--no-early-stop")
    env = {
        **os.environ,
        "KILN_GATE_CACHE": str(out / "gate-cache"),
        "XDG_CACHE_HOME": str(out / "xdg-cache"),
    }
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - began
    if done.returncode not in (0, 1):
        sys.exit(f"kiln search failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def main() -> None:
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    recipe, options = args[0], [a for a in args[1:] if a != "--"]
    print(f"machine: {describe_machine(machine_facts())}")
    with tempfile.TemporaryDirectory(prefix="kiln-search-bench-") as tmp:
        early_s, early = run(recipe, options, Path(tmp), early=True)
        full_s, full = run(recipe, options, Path(tmp), early=False)
    screened = early["early_stop"]["candidates"]
    winners = {
        t: (early["targets"][t]["winner"], full["targets"][t]["winner"]) for t in early["targets"]
    }
    print(
        f"with the early look: {early_s:.0f} s, {len(early['candidates'])} candidates, "
        f"{len(screened)} failed early without a full gate ({', '.join(screened) or 'none'})"
    )
    print(f"without it: {full_s:.0f} s, {len(full['candidates'])} candidates")
    for target, (a, b) in winners.items():
        print(f"{target}: winner {a} with the early look, {b} without")
    print(f"wall time ratio (with / without): {early_s / full_s:.2f}")


if __name__ == "__main__":
    main()
