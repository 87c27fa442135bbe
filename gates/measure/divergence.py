"""Next-token KL divergence and top-1 agreement between two models on the same tokens.

Two inputs are accepted:

- dense: per-token log-probability (or logit) arrays [tokens, vocab] from both sides; the
  exact KL(P_baseline || Q_candidate) per position (llama.cpp's `--kl-divergence` measure);
- top-k: per position, a {token id: logprob} dict from each side (what an engine returns
  with `prompt_logprobs=k`). The distributions are compared on the tokens both dicts
  hold, the baseline's tokens outside the candidate's top k, and a "rest" bucket.
  Merging outcomes never increases KL (the data processing inequality), so this is a lower
  bound of the true KL, tight when the top k hold most of the mass; the summary says which
  was used. Numbers that are not a distribution's (not finite, above 0, summing past 1)
  raise NotMeasured: a KL that cannot be computed is never reported as 0.

Hand-written because it is a few numpy lines; no library computes it from these inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.gates.measure.openai_answers import MASS_SLACK, NotMeasured, logprob

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


def _side_checked(top: dict[int, float], side: str, position: int) -> None:
    """A top-k {token: logprob} dict as a distribution's head: log-probabilities finite and
    at most 0, probabilities summing to at most 1 (NotMeasured naming the side and position)."""
    if not top:
        raise NotMeasured(f"the {side} gave no log-probabilities at position {position}")
    for token, value in top.items():
        logprob(value, f"the {side}'s log-probability of token {token} at position {position}")
    mass = math.fsum(math.exp(v) for v in top.values())
    if mass > 1.0 + MASS_SLACK:
        raise NotMeasured(
            f"the {side}'s top-k probabilities at position {position} sum to {mass:.6g}, "
            "more than 1"
        )


def _term(p: float, q: float) -> float:
    return p * (math.log(p) - math.log(max(q, 1e-12))) if p > 0.0 else 0.0


def _position_kl(p_top: dict[int, float], q_top: dict[int, float]) -> float:
    """A lower bound of KL(P||Q) from P's and Q's top-k: the tokens both hold one by one,
    then P's tokens missing from Q's top-k (A), then the rest (C, which holds Q's own listed
    tokens P does not list). Q's mass on A is unknown but at most |A| times Q's smallest top-k
    probability (each is outside Q's top k) and at most what Q's listed tokens leave free; the
    bound takes the Q split of A and C most favourable to Q within those caps, so tokens the two
    sides rank differently add to it instead of vanishing into one merged bucket."""
    shared = p_top.keys() & q_top.keys()
    kl = math.fsum(math.exp(p_top[t]) * (p_top[t] - q_top[t]) for t in shared)
    p_shared = math.fsum(math.exp(p_top[t]) for t in shared)
    q_rest = max(0.0, 1.0 - math.fsum(math.exp(q_top[t]) for t in shared))
    q_free = max(0.0, 1.0 - math.fsum(math.exp(v) for v in q_top.values()))
    p_a = math.fsum(math.exp(v) for t, v in p_top.items() if t not in shared)
    p_c = max(0.0, 1.0 - p_shared - p_a)
    if p_a + p_c <= 1e-12:
        return kl
    cap = (len(p_top) - len(shared)) * math.exp(min(q_top.values()))
    q_a = min(q_rest * p_a / (p_a + p_c), cap, q_free)
    return kl + _term(p_a, q_a) + _term(p_c, q_rest - q_a)


def kl_topk(
    baseline: Sequence[dict[int, float]], candidate: Sequence[dict[int, float]]
) -> tuple[np.ndarray, np.ndarray]:
    """Per-position lower-bound KL and top-1 agreement from top-k {token: logprob} dicts;
    NotMeasured when either side's numbers are not a distribution's."""
    if len(baseline) != len(candidate):
        raise NotMeasured(
            f"the sides gave log-probabilities for {len(baseline)} and {len(candidate)} "
            "positions of the same text"
        )
    kls, agree = [], []
    for position, (p_top, q_top) in enumerate(zip(baseline, candidate, strict=True)):
        _side_checked(p_top, "baseline", position)
        _side_checked(q_top, "candidate", position)
        # A valid bound is >= 0; what is below is the rounding MASS_SLACK allows.
        kls.append(max(_position_kl(p_top, q_top), 0.0))
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
