"""Input and output processing around the engine's step: a prompt's checks against the
engine's limits before it becomes a Request, each new token's stop rules, and the
log-probability records handed back (with each token's text).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.detokenizer import Detokenizer, find_stop
from kiln.runtime.engine.sampling import Logprob, SamplingParams, token_logprobs
from kiln.runtime.engine.sequence import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What a prompt must fit in this engine: its vocabulary, context, step and KV cache."""

    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    num_blocks: int
    blocks_needed: Callable[[int], int]  # KV blocks a sequence of n tokens holds

    def check(self, rid: str, token_ids: list[int], params: SamplingParams) -> None:
        """UsageError naming request `rid` and the fix where its prompt cannot run here."""
        if not token_ids:
            raise UsageError(f"request {rid}: the prompt is empty; send at least one token")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise UsageError(f"request {rid}: token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise UsageError(
                f"request {rid}: prompt has {len(token_ids)} tokens; the model's limit is "
                f"{self.max_model_len} including output; shorten the prompt"
            )
        budget = self.max_num_batched_tokens
        if not self.chunked_prefill and len(token_ids) > budget:
            raise UsageError(
                f"request {rid}: prompt has {len(token_ids)} tokens, more than "
                f"max_num_batched_tokens={budget} with chunked prefill off; raise the budget "
                "or enable chunked prefill"
            )
        outside = sorted(
            t for t in (*params.stop_token_ids, *params.logit_bias) if not 0 <= t < vocab
        )
        if outside:
            raise UsageError(
                f"request {rid}: stop_token_ids / logit_bias name token ids {outside[:5]} "
                f"outside the vocabulary [0, {vocab})"
            )
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if self.blocks_needed(longest) > self.num_blocks:
            raise UsageError(
                f"request {rid}: needs {self.blocks_needed(longest)} KV blocks but the "
                f"cache has {self.num_blocks}; lower max_tokens or raise kv_cache_memory_bytes"
            )


def stop_status(
    request: Request,
    token: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    detokenizer: Detokenizer | None,
) -> RequestStatus | None:
    """Whether `token`, just appended, finishes `request`, and how (None: it goes on)."""
    params = request.params
    # As vLLM: stop tokens count from the min_tokens-th output token, stop strings after it.
    generated = request.num_output_tokens
    stop_id = token in params.stop_token_ids
    if generated >= params.min_tokens and (
        stop_id or (not params.ignore_eos and token in eos_token_ids)
    ):
        if stop_id:
            request.stop_reason = token
        if params.include_stop_str_in_output and params.detokenize and detokenizer:
            detokenizer.step(request)  # vLLM: the stop token's text is then kept
        return RequestStatus.FINISHED_STOPPED
    if params.detokenize and detokenizer:
        delta = detokenizer.step(request)
        if generated > params.min_tokens and find_stop(request, delta):
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def logprob_entries(
    detokenizer: Detokenizer | None,
    requests: list[Request],
    rows: torch.Tensor,
    tokens: torch.Tensor,
) -> list[dict[int, Logprob] | None]:
    """The chosen token's log-probability record for each request that asked for one."""
    out: list[dict[int, Logprob] | None] = [None] * len(requests)
    wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not wanted:
        return out
    chosen = torch.tensor(wanted, device=rows.device)
    logprobs = torch.log_softmax(rows[chosen], dim=-1)
    top_n = [requests[i].params.logprobs or 0 for i in wanted]
    entries = named(detokenizer, token_logprobs(logprobs, tokens[chosen], top_n))
    for i, entry in zip(wanted, entries, strict=True):
        out[i] = entry
    return out


def named(
    detokenizer: Detokenizer | None, entries: list[dict[int, Logprob]]
) -> list[dict[int, Logprob]]:
    """Fill in each Logprob's token text (what an OpenAI-style response shows)."""
    if detokenizer is not None:
        ids = sorted({token for entry in entries for token in entry})
        texts = dict(zip(ids, detokenizer.token_texts(ids), strict=True))
        for entry in entries:
            for token, logprob in entry.items():
                logprob.decoded_token = texts[token]
    return entries
