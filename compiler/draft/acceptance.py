"""Measuring a draft against its target on this machine: acceptance and decode cost.

A benchmark the compiler runs when it picks a draft length (`kiln compile`'s speculative
stage, `kiln draft`), through kiln's runtime engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.engine.spec_decode.speculator import SpeculativeConfig


@dataclass(slots=True)
class AcceptanceProfile:
    """What `measure_acceptance` found: acceptance a (overall and by draft position), the
    draft/target cost ratio c, and the per-token decode times behind c."""

    alpha: float
    alpha_per_position: list[float]
    cost_ratio: float
    draft_ms_per_token: float
    target_ms_per_token: float
    num_drafts: int


def measure_acceptance(
    target_dir: str | Path,
    draft_dir: str | Path,
    prompts: list[str],
    max_k: int = 8,
    max_tokens: int = 64,
    device: str = "cpu",
) -> AcceptanceProfile:
    """Greedy-decode `prompts` with the draft proposing `max_k` tokens to measure per-position
    acceptance, and time single-stream decode of each model on this device for c."""
    from kiln.runtime.engine.core import Engine  # engine.py imports this module

    spec = SpeculativeConfig(draft=draft_dir, num_speculative_tokens=max_k)
    engine = Engine.load(target_dir, device=device, speculative=spec)
    assert engine.speculator is not None and engine.speculator.proposer is not None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)
    stats = engine.speculator.stats
    per_position = [
        a / r if r else 0.0
        for a, r in zip(stats.accepted_per_pos, stats.reached_per_pos, strict=True)
    ]
    alpha = sum(stats.accepted_per_pos) / max(sum(stats.reached_per_pos), 1)
    prompt = engine.detokenizer.encode(prompts[0]) if engine.detokenizer else [0]
    draft = Engine(engine.speculator.proposer.model, None, engine.config)
    plain = Engine(engine.model, None, engine.config)
    # Best of three each: a shared machine's load only ever makes a step slower.
    steps = min(max_tokens, 32)
    target_ms = min(decode_ms_per_token(plain, prompt, steps) for _ in range(3))
    draft_ms = min(decode_ms_per_token(draft, prompt, steps) for _ in range(3))
    return AcceptanceProfile(
        alpha=alpha,
        alpha_per_position=per_position,
        cost_ratio=draft_ms / target_ms,
        draft_ms_per_token=draft_ms,
        target_ms_per_token=target_ms,
        num_drafts=stats.num_drafts,
    )


def decode_ms_per_token(engine: Any, prompt: list[int], tokens: int) -> float:
    """Median wall time of one single-stream decode step (prefill excluded), in ms."""
    params = SamplingParams(
        max_tokens=tokens + 1, temperature=0, ignore_eos=True, speculative=False
    )
    engine.add_request(prompt, params)
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    times.sort()
    return 1000.0 * times[len(times) // 2]
