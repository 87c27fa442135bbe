"""Batch-invariance audit: a prompt's greedy output alone vs inside a batch of 16.

The runtime is not bitwise batch-invariant: a decode step with one row runs its dense layers
on MKL's gemv (F.linear) while a batch of four rows or more runs on oneDNN's packed GEMM
(dense.py, DenseLinear), and the GEMM libraries block their sums by row count, so the same
row's logits differ in the last float32 bits with the batch around it. Attention is
per-row (padding is masked, never summed), so it adds nothing. The audit states the result
as a rate and bounds the logit drift, so a change that makes batching change the numerics
beyond rounding (a mask bug, a wrong row order) fails here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer

from kiln.runtime import Engine, SamplingParams

BATCH = 16
NEW_TOKENS = 24
# float32 summation-order noise on the tiny model's log-probabilities is ~1e-6.
LOGPROB_TOLERANCE = 1e-4


def audit_prompts(model_dir: Path) -> list[list[int]]:
    """16 distinct prompts of 5 to 80 tokens (mixed lengths: ragged decode rows)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
    return [ids[i * 97 : i * 97 + 5 + 5 * i] for i in range(BATCH)]


def test_greedy_output_alone_matches_inside_a_batch_of_16(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    prompts = audit_prompts(tiny_llama)
    alone_engine = Engine.from_pretrained(tiny_llama, enable_prefix_caching=False)
    alone = [alone_engine.generate([p], params)[0] for p in prompts]
    batch_engine = Engine.from_pretrained(tiny_llama, enable_prefix_caching=False)
    batched = batch_engine.generate(prompts, params)

    identical = sum(a.token_ids == b.token_ids for a, b in zip(alone, batched, strict=True))
    rate = identical / BATCH
    print(f"batch invariance: {identical}/{BATCH} greedy continuations identical ({rate:.0%})")
    drift = 0.0
    for a, b in zip(alone, batched, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        # Compare up to the first differing token: after it the contexts differ.
        same = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y),
            NEW_TOKENS,
        )
        for i in range(same):
            token = a.token_ids[i]
            drift = max(drift, abs(a.logprobs[i][token].logprob - b.logprobs[i][token].logprob))
        if same < NEW_TOKENS:
            # A flip is only acceptable at a near-tie of the two best tokens.
            entry = a.logprobs[same]
            chosen = entry[a.token_ids[same]].logprob
            flipped = entry.get(b.token_ids[same])
            assert flipped is not None and chosen - flipped.logprob < LOGPROB_TOLERANCE
    print(f"max |logprob alone - logprob in batch| before any divergence: {drift:.2e}")
    assert drift < LOGPROB_TOLERANCE
    assert rate == 1.0, (
        f"only {identical}/{BATCH} identical; the divergences are near-ties (checked above)"
    )


def test_packed_and_gemv_paths_agree_to_float_rounding(tiny_llama: Path) -> None:
    """The two dense kernels that make the runtime batch-variant agree to fp32 rounding."""
    engine = Engine.from_pretrained(tiny_llama)
    layer = engine.model.layers[0].gate_up
    x = torch.randn(16, engine.model.config.hidden_size)
    batched = layer(x)
    rows = torch.cat([layer(x[i : i + 1]) for i in range(16)])
    torch.testing.assert_close(batched, rows, rtol=1e-5, atol=1e-5)
