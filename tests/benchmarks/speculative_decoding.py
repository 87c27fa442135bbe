"""Speculative decoding benchmark: decode speedup with a draft vs plain decoding, same run.

Target SmolLM2-135M-Instruct (float32), greedy. For each draft this script measures the
acceptance rate a (greedy, per position) and the cost ratio c (draft decode step / target
decode step, single stream), picks k = argmax (1 - a^(k+1)) / ((1 - a)(k·c + 1)), then times
single-stream decode with and without speculation and prints the measured speedup next to
the formula's. Drafts:

- `w4a16`:   the GPTQ W4A16 SmolLM2 (same model, 4-bit weights: high a, c near its speed ratio)
- `shallowN`: the target's first N layers plus its norm and head (no training)
- `ngram`:   prompt lookup on an extractive prompt (copy a passage), no draft model

Then, for the best draft, output throughput against concurrency (1, 4, 16, 32) for plain
decoding, speculation everywhere, and speculation with the default batch-size fallback.

    flock /tmp/kiln-heavy.lock env PYTHONPATH=. python tests/benchmarks/speculative_decoding.py

Measured on the shared 2-core CPU (2 threads, 48 tokens, best of 2): prompt lookup a = 0.86,
k = 8, 5.75 tokens per pass at 1.57x a plain step's cost: 3.3x single-stream decode (formula
5.2x, which assumes a (k+1)-token verify costs one plain step); W4A16 draft a = 0.64, c = 0.59:
0.86x; 4-layer truncation a = 0.04: 0.79x. Throughput ratio vs concurrency (prompt lookup):
2.9x at 1, 1.6x at 4, 1.1x at 16, 1.0x at 32, where the default fallback (16) decodes plainly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import torch

from kiln.compiler.draft.acceptance import decode_ms_per_token
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine.model import CausalLM
from kiln.runtime.engine.spec_decode.speculator import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    choose_draft_len,
    expected_speedup,
    expected_tokens_per_pass,
)

LICENSES = Path("/usr/share/common-licenses")


def shallow_copy(model: CausalLM, layers: int) -> CausalLM:
    """The target's first `layers` decoder layers with its final norm and head (shared)."""
    config = dataclasses.replace(model.config, num_layers=layers)
    return CausalLM(
        config, model.embed, model.layers[:layers], model.norm, model.lm_head, len(model.cos)
    )


def chat(engine: Engine, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    tokenizer = engine.tokenizer
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def prompts_for(engine: Engine, extractive: bool, count: int) -> list[list[int]]:
    """Chat prompts: open questions, or (extractive) 'repeat this passage' over licence text."""
    text = (LICENSES / "GPL-3").read_text()
    passages = [p.strip() for p in text.split("\n\n") if 300 < len(p.strip()) < 700]
    topics = ["how rain forms", "why the sky is blue", "how a bicycle works", "what a CPU does"]
    out = []
    for i in range(count):
        if extractive:
            passage = " ".join(passages[i % len(passages)].split())
            out.append(chat(engine, f"Repeat the following text exactly:\n\n{passage}"))
        else:
            out.append(chat(engine, f"Explain {topics[i % len(topics)]} in a few sentences."))
    return out


def make_engine(
    plain: Engine, speculative: SpeculativeConfig | None, draft: CausalLM | None = None
) -> Engine:
    """An engine over the plain engine's model (weights shared, own KV caches)."""
    return Engine(
        plain.model,
        plain.tokenizer,
        plain.config,
        None,
        sorted(plain.eos_token_ids),
        speculative,
        draft,
    )


def acceptance(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Greedy per-token acceptance a = accepted / judged draft positions."""
    engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    assert engine.speculator is not None
    stats = engine.speculator.stats
    return sum(stats.accepted_per_pos) / max(sum(stats.reached_per_pos), 1)


def decode_rate(engine: Engine, prompt: list[int], tokens: int, rounds: int) -> tuple[float, float]:
    """Best-of-rounds single-stream decode (tokens/s, ms per step), prefill excluded."""
    best = (0.0, 0.0)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for _ in range(rounds):
        engine.add_request(prompt, params)
        engine.step()  # prefill and first token
        began, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - began
        if (tokens - 1) / wall > best[0]:
            best = ((tokens - 1) / wall, 1000 * wall / steps)
    return best


def cost_ratio(target: Engine, draft: Engine, prompt: list[int], rounds: int = 3) -> float:
    """c: draft / target single-stream decode step time, interleaved, best of rounds each
    (load from other processes only ever slows a step down)."""
    target_ms = draft_ms = float("inf")
    for _ in range(rounds):
        target_ms = min(target_ms, decode_ms_per_token(target, prompt, 16))
        draft_ms = min(draft_ms, decode_ms_per_token(draft, prompt, 16))
    return draft_ms / target_ms


def throughput(engine: Engine, prompts: list[list[int]], tokens: int) -> float:
    """Output tokens/s with every prompt queued at once."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    engine.generate(prompts, params)
    return len(prompts) * tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=Path("/tmp/rt/smol"))
    parser.add_argument("--w4a16", type=Path, default=Path("/tmp/rt/smol-w4a16"))
    parser.add_argument("--shallow", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--drafts", default="ngram,w4a16,shallow")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 32])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    plain = Engine.from_pretrained(args.target, max_model_len=512, max_num_seqs=32)
    open_prompts = prompts_for(plain, extractive=False, count=4)
    copy_prompts = prompts_for(plain, extractive=True, count=4)
    plain.generate([open_prompts[0]], SamplingParams(max_tokens=4))  # warm-up

    drafts: dict[str, tuple[SpeculativeConfig, CausalLM | None, list[list[int]]]] = {}
    wanted = args.drafts.split(",")
    if "ngram" in wanted:
        drafts["ngram"] = (SpeculativeConfig(method="ngram"), None, copy_prompts)
    if "w4a16" in wanted:
        drafts["w4a16"] = (SpeculativeConfig(draft=args.w4a16), None, open_prompts)
    if "shallow" in wanted:
        for layers in args.shallow:
            shallow = shallow_copy(plain.model, layers)
            drafts[f"shallow{layers}"] = (SpeculativeConfig(), shallow, open_prompts)

    print(
        f"target {args.target.name}, greedy, {args.tokens} tokens; a, c measured, k chosen by "
        "the formula;\nE = formula tokens/pass, L = measured tokens/pass, v = measured pass "
        "cost / plain step cost (model: speedup = L / v)"
    )
    print(
        f"{'draft':10s} {'a':>5s} {'c':>5s} {'k':>2s} {'E':>5s} {'L':>5s} {'v':>5s} {'plain':>6s} "
        f"{'spec':>6s} {'speedup':>8s} {'formula':>8s} {'per-position a'}"
    )
    best: tuple[float, str, int] = (0.0, "", 1)
    for name, (config, model, prompts) in drafts.items():
        probe = dataclasses.replace(config, num_speculative_tokens=args.max_k)
        engine = make_engine(plain, probe, model)
        alpha = acceptance(engine, prompts, args.tokens)
        assert engine.speculator is not None
        stats = engine.speculator.stats
        per_pos = [
            a / r if r else 0.0
            for a, r in zip(stats.accepted_per_pos, stats.reached_per_pos, strict=True)
        ]
        proposer = engine.speculator.proposer
        cost = 0.0
        if proposer is not None:
            draft_only = Engine(proposer.model, None, plain.config)
            cost = cost_ratio(plain, draft_only, open_prompts[0])
        k = choose_draft_len(alpha, cost, args.max_k)
        fast = make_engine(plain, dataclasses.replace(config, num_speculative_tokens=k), model)
        base, base_ms = decode_rate(plain, prompts[0], args.tokens, args.rounds)
        spec, spec_ms = decode_rate(fast, prompts[0], args.tokens, args.rounds)
        formula = expected_speedup(alpha, k, cost)
        measured_len = fast.stats().spec_decode_mean_acceptance_length
        print(
            f"{name:10s} {alpha:5.2f} {cost:5.2f} {k:2d} {expected_tokens_per_pass(alpha, k):5.2f} "
            f"{measured_len:5.2f} {spec_ms / base_ms:5.2f} {base:6.1f} {spec:6.1f} "
            f"{spec / base:7.2f}x {formula:7.2f}x " + " ".join(f"{a:.2f}" for a in per_pos)
        )
        if spec / base > best[0]:
            best = (spec / base, name, k)

    _, name, k = best
    config, model, prompts = drafts[name]
    print(f"\nthroughput vs concurrency, draft {name}, k={k}, {args.tokens} tokens per request")
    print(
        f"{'conc':>4s} {'plain':>8s} {'spec':>8s} {'ratio':>6s} {'fallback':>9s} {'ratio':>6s} "
        "drafts/run (fallback engine)"
    )
    always = make_engine(
        plain,
        dataclasses.replace(config, num_speculative_tokens=k, disable_by_batch_size=10**6),
        model,
    )
    fallback = make_engine(plain, dataclasses.replace(config, num_speculative_tokens=k), model)
    for concurrency in args.concurrency:
        batch = [prompts[i % len(prompts)] for i in range(concurrency)]
        base = spec = guarded = 0.0
        before = fallback.stats().spec_decode_num_drafts
        for _ in range(args.rounds):  # interleaved, best of rounds: the box is shared
            base = max(base, throughput(plain, batch, args.tokens))
            spec = max(spec, throughput(always, batch, args.tokens))
            guarded = max(guarded, throughput(fallback, batch, args.tokens))
        drafted = (fallback.stats().spec_decode_num_drafts - before) // args.rounds
        print(
            f"{concurrency:4d} {base:8.1f} {spec:8.1f} {spec / base:5.2f}x {guarded:9.1f} "
            f"{guarded / base:5.2f}x {drafted}"
        )
    print(f"fallback: plain decoding above {DEFAULT_DISABLE_BY_BATCH_SIZE} running requests")


if __name__ == "__main__":
    main()
