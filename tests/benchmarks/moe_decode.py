"""Decode tokens/s of kiln's runtime against transformers on tiny mixture-of-experts models.

    PYTHONPATH=. python tests/benchmarks/moe_decode.py [--tokens 128] [--batch 1,8] [--threads 1]

Builds the test suite's tiny random Qwen3-MoE (3 layers, one dense; 4 experts of width 128,
2 per token, q/k norms) and Mixtral (2 layers, 4 experts, 2 per token) checkpoints, then for
each batch size generates `--tokens` greedy tokens from 16-token prompts, EOS ignored, float32,
on both: kiln's Engine (paged KV, its CPU kernels) and transformers' `generate` (its own KV
cache, the same weights). Each is timed after a warm-up run; the ratio is kiln's tokens/s over
transformers'. Both run on `--threads` torch threads in this one process, one after the other,
so the ratio compares like with like on this machine; prints the machine first.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from kiln.runtime.base.machine import describe_machine, machine_facts
from tests.tiny_models import make_tiny_model

MODELS = {
    "Qwen3-MoE": {"arch": "qwen3_moe", "num_layers": 3, "mlp_only_layers": [1]},
    "Mixtral": {"arch": "mixtral"},
}


def kiln_rate(model_dir: Path, prompts: list[list[int]], tokens: int) -> float:
    engine = Engine.from_pretrained(model_dir, dtype="float32")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    began = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - began
    return sum(len(o.token_ids) for o in outputs) / elapsed


def transformers_rate(model_dir: Path, prompts: list[list[int]], tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # warm-up
        began = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        elapsed = time.perf_counter() - began
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {describe_machine(machine_facts())}; torch threads {args.threads}")
    print("| model | batch | kiln tok/s | transformers tok/s | kiln / transformers |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in MODELS.items():
            model_dir = make_tiny_model(Path(tmp) / name, **spec)  # type: ignore[arg-type]
            for batch in (int(b) for b in args.batch.split(",")):
                prompts = [[(7 * i + 11 * j) % 500 + 3 for j in range(16)] for i in range(batch)]
                ours = kiln_rate(model_dir, prompts, args.tokens)
                theirs = transformers_rate(model_dir, prompts, args.tokens)
                print(f"| {name} | {batch} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
