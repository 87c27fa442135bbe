"""Greedy decode on a CPU with and without the LM head's int8 screen
(runtime/engine/layers/greedy_head.py).

    PYTHONPATH=. python tests/benchmarks/greedy_head.py MODEL [MODEL ...] [--rounds 4]

MODEL: an artifact directory or a Hugging Face checkpoint directory (served in bf16). One
thread, CPU time (time.process_time). Per model: the head alone at 1, 2 and 4 rows (full bf16
head's argmax vs the screen's), and one greedy stream's CPU ms per generated token (a
129-token run less a 1-token one, after the same prompt) with the screen and without. The two
alternate within each round and the best round counts; the tokens of both must be equal. The
CPU and its flags head the output, and ratios compare columns of one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from tests.benchmarks.cpu_comparison import machine

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def best_ms(run: Callable[[], object], calls: int) -> float:
    began = time.process_time()
    for _ in range(calls):
        run()
    return (time.process_time() - began) / calls * 1000


def measure(path: str, rounds: int) -> None:
    artifact = (Path(path) / "manifest.json").exists()
    load = Engine.from_artifact if artifact else Engine.from_pretrained
    engine = load(path, dtype="bfloat16")
    model = engine.runner.model
    screen = model.greedy_head
    if screen is None:
        print(f"{path}: no screen here (the head is not bf16 on kiln's CPU kernel)")
        return
    hidden = model.embed.shape[1]
    print(f"\n{path}: bf16 head {model.lm_head.out_features} x {hidden}")
    for rows in (1, 2, 4):
        x = torch.randn(rows, hidden).bfloat16()
        full = min(
            best_ms(lambda: model.lm_head(x).float().max(dim=-1).indices, 20)  # noqa: B023
            for _ in range(rounds)
        )
        fast = min(best_ms(lambda: screen.argmax(x), 20) for _ in range(rounds))  # noqa: B023
        print(f"  head, {rows} row(s): full {full:.2f} ms, screen {fast:.2f} ms, "
              f"{full / fast:.2f}x")  # fmt: skip
    prompt = engine.tokenizer.encode(PROMPT)

    def tokens(count: int, on: bool) -> tuple[float, list[int]]:
        model.greedy_head = screen if on else None
        params = SamplingParams(max_tokens=count, temperature=0, ignore_eos=True)
        began = time.process_time()
        out = engine.generate([prompt], params)[0].token_ids
        return time.process_time() - began, out

    per_token: dict[bool, list[float]] = {True: [], False: []}
    outs: dict[bool, list[int]] = {}
    for _ in range(rounds):
        for on in (True, False):
            long, outs[on] = tokens(129, on)
            short, _ = tokens(1, on)
            per_token[on].append((long - short) / 128 * 1000)
    model.greedy_head = screen
    assert outs[True] == outs[False], "the screen changed a greedy token"
    on, off = min(per_token[True]), min(per_token[False])
    print(f"  greedy decode: {on:.1f} ms/token with the screen, {off:.1f} without, "
          f"{off / on:.2f}x; tokens identical")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    for path in args.models:
        measure(path, args.rounds)


if __name__ == "__main__":
    main()
