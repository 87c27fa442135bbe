"""Sampling: per-request parameters, the batched sampler, and log-probability records.

Temperature, min-p, top-k and top-p are applied to the whole batch with tensor ops; only
requests with their own seed draw their noise row by row, from their own `torch.Generator`, so
a seeded request gives the same tokens whatever else shares its batch. Log-probabilities are
those of the raw model distribution (before any of this), as vLLM's default logprobs mode.

Before sampling, `process_logits` applies what vLLM applies in the same order: min_tokens
(the request's stop tokens at -inf until it has that many), logit_bias, then the repetition
penalty (prompt and output tokens: positive logits divided by it, negative ones multiplied) and
OpenAI's presence and frequency penalties (output tokens: logit -= frequency * count +
presence * [count > 0]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine import native


@dataclass(slots=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops.

    temperature 0 means greedy. `logprobs=n` returns the sampled token's log-probability and
    the top n; `prompt_logprobs=n` does the same for every prompt token after the first, or
    from token `prompt_logprobs_start` on (earlier entries are None): the positions before it
    are not scored, so the prefix cache may serve them (scoring several continuations of one
    context computes the context once).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: stop tokens and strings are not honoured before this many output tokens.
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    detokenize: bool = True
    skip_special_tokens: bool = True
    # False opts this request out of speculative decoding (plain one-token steps).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        problems = []
        if self.max_tokens < 1:
            problems.append(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k < 0:
            problems.append(f"top_k={self.top_k} must be >= 0 (0 turns it off)")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p={self.min_p} must be in [0, 1]")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens={self.min_tokens} must be in [0, max_tokens]")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty={self.repetition_penalty} must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name}={getattr(self, name)} must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                problems.append(f"{name}={value} must be >= 0 (or None)")
        if self.prompt_logprobs_start < 1:
            problems.append(
                f"prompt_logprobs_start={self.prompt_logprobs_start} must be >= 1 (the first "
                "prompt token has no log-probability)"
            )
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            problems.append("stop strings need detokenize=True")
        if problems:
            raise UsageError("invalid sampling params: " + "; ".join(problems))

    @property
    def processes_logits(self) -> bool:
        """Whether `process_logits` changes this request's logits (then its steps need logits,
        not the model's argmaxes, and it is not speculated)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
        )

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax: temperature 0 (or below SAMPLING_EPS, which
        no distribution can be computed at), or a top-k of one."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


# Below this temperature a request is greedy, as in vLLM: its distribution is one-hot to
# within float32, and dividing logits by it overflows.
SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator on `device` seeded for one request, or None to use the global RNG."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of `logits` [n, vocab] (the first maximum, the first NaN where a row
    holds one): kiln's native pass on CPU (32 rows of a 49k vocabulary, one thread, a 2-core
    Xeon: 0.16-0.18 ms with AVX-512, 0.65 ms built for AVX2, against 1.1-1.2 ms for torch's
    max of the float32 logits), torch's max elsewhere (its indices are argmax's)."""
    if (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.dtype in (torch.float32, torch.bfloat16)
        and native.available()
    ):
        return torch.ops.kiln.argmax_rows(logits)
    return logits.max(dim=-1).indices


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Choose one token per row of `logits` [n, vocab] (float32); returns int64 [n]."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    tokens = greedy_tokens(logits)
    if not sampled:
        return tokens
    rows = torch.tensor(sampled, device=logits.device)
    chosen = [params[i] for i in sampled]
    probs = probabilities(logits[rows], chosen)
    tokens[rows] = draw(probs, [generators[i] for i in sampled])
    return tokens


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    stop_ids: list[frozenset[int]],
) -> torch.Tensor:
    """Each row's logits after its min_tokens, logit_bias and penalties (see the module
    docstring); rows whose params change nothing are returned as they are. `stop_ids`: each
    request's stop tokens (its eos unless ignore_eos, and its stop_token_ids)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p, row = params[i], logits[i]
        if len(outputs[i]) < p.min_tokens and stop_ids[i]:
            row[torch.tensor(sorted(t for t in stop_ids[i] if t < vocab), dtype=torch.int64)] = (
                float("-inf")
            )
        for token, bias in p.logit_bias.items():
            row[token] += bias
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(prompts[i] + outputs[i], dtype=torch.int64, device=row.device)] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if (p.presence_penalty or p.frequency_penalty) and outputs[i]:
            ids = torch.tensor(outputs[i], dtype=torch.int64, device=row.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row of `logits` samples from: softmax after the row's
    temperature, min-p, top-k and top-p (non-greedy params only)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    # From each row's maximum down: a small temperature sends the rest to -inf, never the
    # maximum itself (0 / t is 0), so the softmax stays a distribution.
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = _top_k_top_p(_min_p(shifted / temps.unsqueeze(1), params), params)
    return torch.softmax(scaled, dim=-1)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens whose probability (after temperature) is below min_p times the row's
    largest, as vLLM does; `logits` are shifted so that each row's maximum is 0."""
    if all(p.min_p == 0 for p in params):
        return logits
    ps = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    # p_i / p_max = exp(logit_i - logit_max), and the maximum is 0 here.
    return logits.masked_fill(logits.exp() < ps.unsqueeze(1), float("-inf"))


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab]; seeded rows draw from their own generator."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p, and lets one
    # tensor op serve every unseeded row.
    noise = torch.empty_like(probs).exponential_()
    for j, generator in enumerate(generators):
        if generator is not None:
            noise[j] = torch.empty_like(probs[j]).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if all(k == 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab, device = logits.shape[-1], logits.device
    ordered, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    keep = torch.arange(vocab, device=device).unsqueeze(0) < ks.unsqueeze(1)
    ps = torch.tensor(top_p, dtype=logits.dtype, device=device)
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below p: the top token always survives.
    before = probs.cumsum(dim=-1) - probs
    keep &= before < ps.unsqueeze(1)
    keep[:, 0] = True  # a top_p that rounds to 0 in the logits' dtype keeps the top token
    masked = ordered.masked_fill(~keep, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: list[int]
) -> list[dict[int, Logprob]]:
    """Per row of `logprobs` [n, vocab]: the chosen token's Logprob and the row's top n."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    widest = max(top_n, default=0)
    top_values, top_ids = (
        logprobs.topk(widest, dim=1) if widest else (logprobs[:, :0], token_ids.view(-1, 1)[:, :0])
    )
    chosen_l, ranks_l = chosen.flatten().tolist(), ranks.tolist()
    values_l, ids_l = top_values.tolist(), top_ids.tolist()
    out: list[dict[int, Logprob]] = []
    for row, token in enumerate(token_ids.tolist()):
        entry = {ids_l[row][r]: Logprob(values_l[row][r], r + 1) for r in range(top_n[row])}
        entry[token] = Logprob(chosen_l[row], ranks_l[row])
        out.append(entry)
    return out
