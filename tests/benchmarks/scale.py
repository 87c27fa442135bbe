"""`kiln compile` at the sizes teams ship: per stage, seconds, seconds per billion parameters and
peak RSS over the checkpoint's bf16 bytes, and the artifact's bytes over the weights'.

    PYTHONPATH=. python tests/benchmarks/scale.py [--models llama-1b,llama-3b] \
        [--recipes fp8,w8a8,gptq,awq,modelopt-fp8,modelopt-awq,modelopt-w8a8] [--oneshot] \
        [--pairs N] [--work /path/with/disk]

Each model is a random-weight checkpoint of a real model's shape with SmolLM2's tokenizer,
built once under --work (tests/scale_models.py: llama-1b, llama-3b, llama-8b, qwen3-moe-2b,
guard-300m). Each compile runs in its own process with a fresh stage cache; its process tree's
RSS is sampled every 0.1 s and charged to the stage its progress names (the report and the
exports run at once: one figure for both; their seconds overlap), and the tree's peak is also
read as the kernel counts it (getrusage of the children: the largest single process, as
`/usr/bin/time -v` reports it). The sampled sum is the stricter figure where processes run at
once (the quantiser beside the report's float half), though it counts pages they share (the
libraries both map) once in each. --oneshot runs llm-compressor's own `oneshot` +
`save_pretrained` on the same model and calibration data beside each FP8 compile, as its users
run it (the whole model loaded in bf16), and prints kiln's wall time over it (--one-pass:
oneshot told to skip the second pass over each layer that its default runs and kiln leaves out
for FP8; --pairs N: N compile-then-oneshot pairs, each ratio and their median: a shared host
drifts by 10-20% between runs minutes apart). Each run starts with the checkpoint read once
into the page cache, in this process's environment (`kiln` sets OMP_WAIT_POLICY for itself
where it is not set; oneshot runs with OpenMP's default, as its users run it: 0.7-1.4 s
faster than with PASSIVE at 1.17B).
16×128 calibration tokens, 8×128 report tokens, one target (h100-sxm). The CPU, its flags and
the date head the output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.cpu_comparison import machine
from tests.scale_models import SHAPES, build, weight_bytes

REPO = Path(__file__).resolve().parents[2]
QUANTIZATION: dict[str, dict[str, Any]] = {
    "fp8": {"method": "fp8", "activations": "fp8_static"},
    "w8a8": {"method": "smoothquant", "weight_bits": 8, "activations": "int8_dynamic"},
    "gptq": {"method": "gptq", "weight_bits": 4, "group_size": 128},
    "awq": {"method": "awq", "weight_bits": 4, "group_size": 128},
    "modelopt-fp8": {"method": "fp8", "activations": "fp8_static", "backend": "modelopt"},
    "modelopt-awq": {
        "method": "awq",
        "weight_bits": 4,
        "group_size": 128,
        "symmetric": True,
        "backend": "modelopt",
    },
    "modelopt-w8a8": {
        "method": "smoothquant",
        "weight_bits": 8,
        "activations": "int8_static",
        "backend": "modelopt",
    },
}
# `kiln compile`'s progress in a log: "HH:MM:SS quantize: ...".
# TensorRT-LLM runs INT8 SmoothQuant in 1.2 engines only, not on its PyTorch path.
DEPLOY: dict[str, dict[str, Any]] = {"w8a8": {"trtllm_path": "engine"},
                                     "modelopt-w8a8": {"trtllm_path": "engine"}}  # fmt: skip
STAGE = re.compile(r"^\d\d:\d\d:\d\d (?:draft: )?(source|quantize|report|export|package)\b")
GB = 1e9
# The report and the exports run at once (compiler/pipeline.py): their memory is sampled as one.
TOGETHER = "report+export"


def sampled_as(stage: str) -> str:
    """The name a stage's RSS samples are charged to."""
    stage = stage.split("-")[0]
    return TOGETHER if stage in ("report", "export") else stage


def recipe(model: Path, name: str, scheme: str, out: Path) -> Path:
    """A recipe compiling `model` with `scheme`: 16×128 calibration, 8×128 report tokens."""
    data = {
        "name": name,
        "model": {"source": str(model)},
        "quantization": {**QUANTIZATION[scheme], "ignore": ["lm_head"]},
        "calibration": {"dataset": "builtin:licenses", "num_samples": 16, "max_seq_len": 128},
        "report": {"dataset": "builtin:licenses", "num_samples": 8, "max_seq_len": 128},
        "targets": ["h100-sxm"],
        "output": str(out),
    }
    if scheme in DEPLOY:
        data["deploy"] = DEPLOY[scheme]
    path = out / f"{name}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


class TreeSampler:
    """The RSS of a process and its descendants, sampled, charged to the stage it is in."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.stage = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in procs)
            except psutil.Error:
                rss = 0
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(argv: list[str], env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Run `argv` (a `kiln compile --json`) measured: its JSON, per-stage peaks, the tree's
    peak RSS as getrusage counts it and the wall time."""
    began = time.perf_counter()
    wrapper = [sys.executable, "-c",
               "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(code)", *argv]  # fmt: skip
    proc = subprocess.Popen(wrapper, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    sampler = TreeSampler(proc.pid)
    assert proc.stderr is not None and proc.stdout is not None
    log = []
    for line in proc.stderr:
        log.append(line)
        found = STAGE.match(line.strip())
        if found:
            sampler.stage = sampled_as(found.group(1))
    out = proc.stdout.read()
    proc.wait()
    sampler.stop()
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}:\n{''.join(log[-30:])}")
    maxrss_kb = int(log[-1].strip())
    return {"stdout": out, "peaks": sampler.peaks, "maxrss": maxrss_kb * 1024,
            "wall": wall}, "".join(log)  # fmt: skip


def du(path: Path) -> int:
    """Bytes on disk under `path`, a hard-linked file counted once."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def warm(model: Path) -> None:
    """Read the checkpoint's files once, so each measured run starts with them in the page
    cache (otherwise the first run reads the disk and the next one, side by side, does not)."""
    for path in sorted(model.iterdir()):
        if path.is_file():
            with path.open("rb") as handle:
                while handle.read(64 << 20):
                    pass


def compile_row(model: Path, scheme: str, work: Path) -> dict[str, Any]:
    warm(model)
    out = Path(tempfile.mkdtemp(prefix=f"{model.name}-{scheme}-", dir=work))
    path = recipe(model, f"scale-{model.name}-{scheme}", scheme, out)
    env = {**os.environ, "XDG_CACHE_HOME": str(out / "cache")}
    kiln = [sys.executable, "-m", "kiln.compiler.cli", "compile", str(path), "--json"]
    result, _ = measure(kiln, env)
    compiled = json.loads(result["stdout"])
    artifact = Path(compiled["artifact"])
    stages = {k: v["seconds"] for k, v in compiled["stages"].items()}
    return {"model": model.name, "scheme": scheme, "stages": stages, "peaks": result["peaks"],
            "maxrss": result["maxrss"], "wall": result["wall"], "artifact": du(artifact),
            "model_dir": du(artifact / "model"), "out": str(out)}  # fmt: skip


ONESHOT = """
import sys, json, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from kiln.quant.backends.cpu_workarounds import llmcompressor_on_cpu
from kiln.quant.quantize import calibration_samples
from kiln.quant.spec import CalibrationSpec
src, out = sys.argv[1], sys.argv[2]
one_pass = sys.argv[3:] == ["one-pass"]  # oneshot without its second pass, as kiln runs FP8
tok = AutoTokenizer.from_pretrained(src)
spec = CalibrationSpec(dataset="builtin:licenses", num_samples=16, max_seq_len=128)
samples, _ = calibration_samples(spec, tok)
data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
group = {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
         "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                               "dynamic": False, "symmetric": True, "observer": "static_minmax"}}
with llmcompressor_on_cpu():
    oneshot(model=model, tokenizer=tok, dataset=data, num_calibration_samples=len(samples),
            max_seq_length=128, shuffle_calibration_samples=False, propagate_error=not one_pass,
            recipe=[QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])])
model.save_pretrained(out, save_compressed=True, max_shard_size="5GB")
"""


def oneshot_row(model: Path, work: Path, one_pass: bool = False) -> dict[str, Any]:
    warm(model)
    out = Path(tempfile.mkdtemp(prefix=f"{model.name}-oneshot-", dir=work))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", ONESHOT, str(model), str(out / "model")]
    result, _ = measure(argv + (["one-pass"] if one_pass else []), env)
    return {"wall": result["wall"], "maxrss": result["maxrss"], "out": str(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-1b,llama-3b")
    parser.add_argument("--recipes", default="fp8")
    parser.add_argument("--oneshot", action="store_true")
    parser.add_argument("--pairs", type=int, default=1,
                        help="With --oneshot: compile and oneshot this many times, one after "
                        "the other (the host's speed drifts), and print each ratio")  # fmt: skip
    parser.add_argument("--one-pass", action="store_true",
                        help="With --oneshot: run oneshot without its second pass over each "
                        "layer (propagate_error=False), as kiln runs FP8, rather than as its "
                        "users run it by default")  # fmt: skip
    parser.add_argument("--work", type=Path, default=Path("/tmp/kiln-scale"))
    parser.add_argument("--keep", action="store_true", help="Keep each compile's output.")
    args = parser.parse_args()
    print(machine())
    print(time.strftime("date: %Y-%m-%d"))
    rows = []
    for name in args.models.split(","):
        model = args.work / "models" / name
        if not (model / "config.json").is_file():
            build(SHAPES[name], model)
        bf16 = weight_bytes(model)
        billions = bf16 / 2 / 1e9
        for scheme in args.recipes.split(","):
            row = compile_row(model, scheme, args.work)
            if args.oneshot and scheme == "fp8":
                base = oneshot_row(model, args.work, args.one_pass)
                row["oneshot_wall"], row["oneshot_maxrss"] = base["wall"], base["maxrss"]
                subprocess.run(["rm", "-rf", base["out"]], check=False)
                row["ratios"] = [row["wall"] / base["wall"]]
                for _ in range(args.pairs - 1):  # compile, then oneshot, again and again
                    again = compile_row(model, scheme, args.work)
                    subprocess.run(["rm", "-rf", again["out"]], check=False)
                    other = oneshot_row(model, args.work, args.one_pass)
                    subprocess.run(["rm", "-rf", other["out"]], check=False)
                    row["ratios"].append(again["wall"] / other["wall"])
            rows.append(row)
            print(f"\n{name} ({billions:.2f}B parameters, {bf16 / GB:.2f} GB bf16), {scheme}:")
            for stage, seconds in row["stages"].items():
                peak = row["peaks"].get(sampled_as(stage), 0)
                print(f"  {stage:<11} {seconds:8.1f} s  {seconds / billions:8.1f} s/B  "
                      f"peak RSS {peak / GB:6.2f} GB = {peak / bf16:4.2f}x bf16")  # fmt: skip
            limit = 1.5 * bf16 + 2 * 2**30
            summed = max(row["peaks"].values(), default=0)
            print(f"  compile     {row['wall']:8.1f} s wall; peak RSS (getrusage) "
                  f"{row['maxrss'] / GB:.2f} GB = {row['maxrss'] / bf16:.2f}x bf16, "
                  f"summed over the tree {summed / GB:.2f} GB = {summed / bf16:.2f}x "
                  f"(goal <= {limit / GB:.2f} GB)")  # fmt: skip
            print(f"  artifact    {row['artifact'] / GB:.2f} GB on disk = "
                  f"{row['artifact'] / row['model_dir']:.2f}x model/ "
                  f"({row['model_dir'] / GB:.2f} GB)")  # fmt: skip
            if "oneshot_wall" in row:
                told = " (one pass)" if args.one_pass else ""
                print(f"  oneshot{told}     {row['oneshot_wall']:8.1f} s wall, peak "
                      f"{row['oneshot_maxrss'] / GB:.2f} GB; kiln compile / oneshot = "
                      f"{row['wall'] / row['oneshot_wall']:.2f}")  # fmt: skip
            if len(row.get("ratios", [])) > 1:
                ratios = sorted(row["ratios"])
                print(f"  {len(ratios)} pairs      kiln compile / oneshot = "
                      f"{', '.join(f'{r:.2f}' for r in row['ratios'])}; median "
                      f"{ratios[len(ratios) // 2]:.2f}")  # fmt: skip
            if not args.keep:
                subprocess.run(["rm", "-rf", row["out"]], check=False)
    print("\n" + json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
