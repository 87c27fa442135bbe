"""Next-token KL divergence and top-1 agreement between two models on the same tokens.

Two inputs are accepted:

- dense: per-token log-probability (or logit) arrays [tokens, vocab] from both sides; the
  exact KL(P_baseline || Q_candidate) per position (llama.cpp's `--kl-divergence` measure);
- top-k: per position, a {token id: logprob} dict from each side (what an engine returns
  with `prompt_logprobs=k`). The distributions are compared on the tokens both dicts
  hold plus one "rest" bucket holding the remaining mass of each side. Merging outcomes
  never increases KL (the data processing inequality), so this is a lower bound of the
  true KL, tight when the top k hold most of the mass; the summary says which was used.

Hand-written because it is a few numpy lines; no library computes it from these inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Per-token KL values are binned on a log scale for the report's histogram.
_HIST_EDGES = [0.0, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, math.inf]


@dataclass(slots=True)
class DivergenceSummary:
    """KL(baseline || candidate) per token, summarised, with top-1 agreement."""

    method: str  # "dense" or "topk-<k>"
    num_tokens: int
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    histogram: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DivergenceSummary:
        return cls(**data)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def kl_dense(baseline: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position KL(P||Q) and top-1 agreement from [tokens, vocab] logprobs or logits."""
    if baseline.shape != candidate.shape or baseline.ndim != 2:
        raise ValueError(
            f"dense KL needs two [tokens, vocab] arrays of one shape, got {baseline.shape} "
            f"and {candidate.shape}"
        )
    log_p, log_q = _log_softmax(baseline), _log_softmax(candidate)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    agree = log_p.argmax(axis=-1) == log_q.argmax(axis=-1)
    return np.maximum(kl, 0.0), agree


def kl_topk(
    baseline: Sequence[dict[int, float]], candidate: Sequence[dict[int, float]]
) -> tuple[np.ndarray, np.ndarray]:
    """Per-position lower-bound KL and top-1 agreement from top-k {token: logprob} dicts."""
    if len(baseline) != len(candidate):
        raise ValueError(f"top-k KL needs aligned positions: {len(baseline)} vs {len(candidate)}")
    kls, agree = [], []
    for p_top, q_top in zip(baseline, candidate, strict=True):
        shared = sorted(set(p_top) & set(q_top))
        p = np.exp(np.array([p_top[t] for t in shared], dtype=np.float64))
        q = np.exp(np.array([q_top[t] for t in shared], dtype=np.float64))
        p_rest = max(0.0, 1.0 - float(p.sum()))
        q_rest = max(0.0, 1.0 - float(q.sum()))
        kl = float((p * (np.log(p) - np.log(q))).sum()) if shared else 0.0
        if p_rest > 1e-12:
            kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
        kls.append(max(kl, 0.0))
        agree.append(max(p_top, key=p_top.__getitem__) == max(q_top, key=q_top.__getitem__))
    return np.array(kls, dtype=np.float64), np.array(agree, dtype=bool)


def summarize(kl: np.ndarray, agree: np.ndarray, method: str) -> DivergenceSummary:
    """Mean, median, p99 and max of per-token KL, top-1 agreement, and a log-scale histogram."""
    if kl.size == 0:
        raise ValueError("no tokens to compare: the divergence texts were empty")
    top = max(float(kl.max()), _HIST_EDGES[-2]) + 1.0
    counts, _ = np.histogram(kl, bins=np.array([*_HIST_EDGES[:-1], top]))
    histogram = [
        {"lo": lo, "hi": hi if math.isfinite(hi) else None, "count": int(c)}
        for lo, hi, c in zip(_HIST_EDGES[:-1], _HIST_EDGES[1:], counts, strict=True)
    ]
    return DivergenceSummary(
        method=method,
        num_tokens=int(kl.size),
        kl_mean=float(kl.mean()),
        kl_median=float(np.median(kl)),
        kl_p99=float(np.percentile(kl, 99)),
        kl_max=float(kl.max()),
        top1_agreement=float(agree.mean()),
        histogram=histogram,
    )
