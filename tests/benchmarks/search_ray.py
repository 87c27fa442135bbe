"""What a Ray cluster saves `kiln search`: the same 4-candidate search serially and on a local
Ray head, in one run.

    PYTHONPATH=. python tests/benchmarks/search_ray.py [RECIPE -- kiln search options]

Without arguments: a small random Llama that the script makes (8 layers, hidden 512), a
recipe whose calibration and gate take each candidate tens of seconds here, and the
uniform schemes fp8, fp8_dynamic, w8a16 and w4a16 (`--kv-cache none --no-mixed
--no-measure`). Starts a real Ray head on this machine
(`ray start --head`, every core, tests/compiler/test_search_ray.py), runs the search once
serially and once with `--ray`, each in fresh directories with its own registry, gate
cache and per-user cache (nothing measured in one run serves the other; a warm-up search
first builds the runtime's kernels both use), and prints the machine, both wall times, their
ratio and whether both reached the same verdicts and winner. A candidate on the cluster takes
one CPU (and one torch thread); the serial search uses every core for each candidate, so
on N cores the gain is bounded by N.
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
from tests.compiler.test_search_ray import RayHead
from tests.tiny_models import make_tiny_model

DEFAULT = ["--schemes", "fp8,fp8_dynamic,w8a16,w4a16", "--kv-cache", "none", "--no-mixed",
           "--no-measure"]  # fmt: skip


def small_recipe(root: Path) -> Path:
    """A small Llama (8 layers, hidden 512) and a gate that takes a candidate tens of
    seconds here: enough work that a worker's start (its imports) and the baseline's first
    evaluation do not make up most of it."""
    model = make_tiny_model(root / "model", hidden_size=512, num_layers=8, num_heads=8,
                            num_kv_heads=4, intermediate_size=1536)  # fmt: skip
    path = root / "recipe.yaml"
    path.write_text(
        f"name: small\nmodel:\n  source: {model}\n"
        "calibration: {dataset: builtin:licenses, num_samples: 64, max_seq_len: 256}\n"
        "report: {num_samples: 8, max_seq_len: 128}\ntargets: [h100-sxm]\n"
        "deploy: {gpu_price_per_hour: 3.0}\noutput: out\n"
        "gates:\n  tasks: [kiln_mc]\n  limit: 24\n"
        "  divergence: {num_texts: 16, max_seq_len: 128, top_k: 512}\n"
        "  thresholds: {kl_mean: 1.0}\n"
    )
    return path


def search(recipe: str, options: list[str], out: Path) -> tuple[float, dict]:
    """One `kiln search` in `out`, its wall time and search.json."""
    argv = [sys.executable, "-m", "kiln.compiler.cli.main", "search", recipe, "--json",
            "--output", str(out), "--registry", str(out.with_suffix(".db")), *options]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - began
    if done.returncode not in (0, 1):
        sys.exit(f"kiln search failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def isolated(root: Path) -> None:
    """This process's (and what it starts') caches under `root`."""
    os.environ["XDG_CACHE_HOME"] = str(root / "xdg-cache")
    os.environ["KILN_GATE_CACHE"] = str(root / "gate-cache")


def verdicts(answer: dict) -> dict[str, bool]:
    return {c["id"]: c["quality"]["passed"] for c in answer["candidates"] if c["quality"]}


def main() -> None:
    args = sys.argv[1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The runtime's native kernels are built once, here, not in each run's fresh cache.
    home_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(home_cache / "torch_extensions"))
    cores = os.cpu_count() or 1
    print(f"machine: {describe_machine(machine_facts())}")
    with tempfile.TemporaryDirectory(prefix="kiln-ray-bench-") as tmp:
        root = Path(tmp)
        if args:
            recipe, options = args[0], [a for a in args[1:] if a != "--"]
        else:
            recipe, options = str(small_recipe(root)), DEFAULT
        isolated(root / "warm-up")
        search(recipe, [*options, "--max-candidates", "1"], root / "warm-up" / "search")
        isolated(root / "serial")
        serial_s, serial = search(recipe, options, root / "serial" / "search")
        isolated(root / "ray")  # the head's workers inherit these caches
        head = RayHead(cpus=cores)
        try:
            ray_s, on_ray = search(
                recipe, [*options, "--ray", head.address], root / "ray" / "search"
            )
        finally:
            head.stop()
    print(f"serial: {serial_s:.1f} s, {len(serial['candidates'])} candidates")
    print(f"ray (local head, {cores} CPUs, {on_ray['cluster']['slots']} candidates at once): "
          f"{ray_s:.1f} s, {len(on_ray['candidates'])} candidates")  # fmt: skip
    for target in serial["targets"]:
        a, b = serial["targets"][target]["winner"], on_ray["targets"][target]["winner"]
        print(f"{target}: winner {a} serially, {b} on Ray")
    print(f"same verdicts: {verdicts(serial) == verdicts(on_ray)}")
    for name, answer in (("serial", serial), ("ray", on_ray)):
        each = ", ".join(f"{c['id']} {c['seconds']:.0f} s" for c in answer["candidates"])
        print(f"{name} candidates: {each}")
    print(f"wall time ratio (serial / ray): {serial_s / ray_s:.2f} (bound: {cores}x)")


if __name__ == "__main__":
    main()
