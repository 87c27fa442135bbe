"""kiln's runtime against transformers + compressed-tensors on SmolLM2-135M, per format, next to
transformers' own spread (tests/fidelity.py says why that is the yardstick).

    PYTHONPATH=. python tests/benchmarks/fidelity.py [--model NAME=DIR ...] [--work DIR]

Without --model: the embedded SmolLM2-135M-Instruct as a float checkpoint and each of
tests/fidelity.py's formats written from it by llm-compressor. --model adds checkpoints or
artifacts (e.g. `kiln compile` outputs) under a name. Per checkpoint, on four 128-token windows
of the GPL-3 text: mean / max |delta logprob| of kiln's float32 and bfloat16 engines against
transformers in float32, and of transformers against itself with each decoder layer's output
moved by one part in 10^7; then eight prompts' 32-token greedy continuations: how many of
kiln's (float32) and of the jittered reference's equal transformers'. Two threads. The CPU and
its flags head the output.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from tests import fidelity
from tests.benchmarks.cpu_comparison import machine

PROMPTS = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "This program is free software; you can redistribute it",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND",
    "Licensed under the Apache License",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
]
TOKENS = 32


def hf_greedy(model: object, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for ids in prompts:
            tokens = model.generate(  # type: ignore[attr-defined]
                torch.tensor([ids]),
                max_new_tokens=TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(tokens[0, len(ids) :].tolist())
    return out


def row(name: str, model_dir: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    windows = fidelity.token_windows(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = fidelity.reference_logprobs(reference, windows)
    with fidelity.layer_jitter(reference):
        spread = fidelity.deviation(fidelity.reference_logprobs(reference, windows), expected)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    greedy = hf_greedy(reference, prompts)
    with fidelity.layer_jitter(reference):
        jittered = hf_greedy(reference, prompts)
    cells = []
    same = 0
    for dtype in ("float32", "bfloat16"):
        engine = Engine.from_pretrained(model_dir, dtype=dtype)
        mean, top = fidelity.deviation(fidelity.engine_logprobs(engine, windows), expected)
        cells.append(f"{mean:.2g} / {top:.2g}")
        if dtype == "float32":
            params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
            ours = [out.token_ids for out in engine.generate(prompts, params)]
            same = sum(a == b for a, b in zip(ours, greedy, strict=True))
        del engine
    jitter_same = sum(a == b for a, b in zip(jittered, greedy, strict=True))
    return (
        f"| {name} | {cells[0]} | {spread[0]:.2g} / {spread[1]:.2g} | {cells[1]} "
        f"| {same}/8 | {jitter_same}/8 |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--work", type=Path, help="where the formats are written (a temp dir)")
    parser.add_argument("--formats", default=",".join(fidelity.MODES))
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-fidelity-"))
    models: list[tuple[str, Path]] = []
    if args.formats:
        from kiln.compiler import sources

        ref = sources.parse_source("builtin:smollm2-135m-instruct", base_dir=work)
        source = sources.materialize(ref, work / "float-source")
        for mode in args.formats.split(","):
            out = work / mode
            models.append((mode, out if out.is_dir() else fidelity.quantise(source, mode, out)))
    for spec in args.model:
        name, _, path = spec.partition("=")
        model_dir = Path(path)
        models.append(
            (name, model_dir / "model" if (model_dir / "manifest.json").is_file() else model_dir)
        )
    print(machine())
    print("| format | kiln float32 vs transformers | transformers jittered | kiln bfloat16 "
          "| greedy equal, kiln float32 | greedy equal, jittered |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, model_dir in models:
        print(row(name, model_dir), flush=True)


if __name__ == "__main__":
    main()
