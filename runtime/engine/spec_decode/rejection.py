"""Verifying draft tokens: greedy matching and speculative rejection sampling.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x_i, drawn from the
draft's distribution q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)) where p_i is
the target's distribution at that position; at the first rejection the replacement is drawn
from norm(max(0, p_i - q_i)), and when every draft is accepted a bonus token is drawn from the
target's next distribution. Every emitted token is then distributed exactly as plain sampling
from the target would give. p and q are the *processed* distributions (temperature, top-k,
top-p applied the same way on both sides), so the request's sampling settings hold too.
A draft-free proposer (n-gram lookup) is a deterministic q: a one-hot at the proposed token.

Hand-written rather than taken from vLLM's kernel because ours runs one request's rows at a
time with that request's own torch.Generator, so a seeded request is reproducible whatever
else shares its batch, as with plain sampling (sampling.py).
"""

from __future__ import annotations

import torch


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """Temperature 0: accept drafts while each equals the target's argmax, then emit the
    target's argmax at the first mismatch (or the bonus position). `target_logits` is
    [len(drafts) + 1, vocab]; returns the emitted tokens (accepted drafts + one)."""
    targets = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    drafts: list[int],
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling for one request.

    `target_probs` [k + 1, vocab] is the target's processed distribution at each draft
    position and the bonus position; `draft_probs` [k, vocab] the draft's at each draft
    position (None for a deterministic proposer: a one-hot at each draft token). Returns the
    emitted tokens: the accepted drafts, then one token resampled or drawn as the bonus.
    """
    k = len(drafts)
    device = target_probs.device
    index = torch.tensor(drafts, device=device).view(-1, 1)
    p = target_probs[:k].gather(1, index).flatten()
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(1, index).flatten()
    uniform = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
    # u < p / q written as u * q < p: no division, and q > 0 wherever the draft sampled.
    rejected = (uniform * q >= p).tolist()
    accepted = rejected.index(True) if True in rejected else k
    if accepted == k:
        final = target_probs[k]
    else:
        target = target_probs[accepted]
        if draft_probs is None:
            residual = target.clone()
            residual[drafts[accepted]] = 0
        else:
            residual = (target - draft_probs[accepted]).clamp_(min=0)
        # p == q on the support leaves no residual mass; then p itself is the right law.
        final = residual if float(residual.sum()) > 0 else target
    token = int(torch.multinomial(final, 1, generator=generator))
    return [*drafts[:accepted], token]
