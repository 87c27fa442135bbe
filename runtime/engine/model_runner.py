"""ModelRunner: turns a scheduler step into model inputs, runs the forward, returns logits
(or, on a step whose rows all sample greedily without log-probabilities, their argmaxes).

The step's tokens are laid out decodes first (requests advancing by one token), then prefill
chunks. For each request the runner records which logits rows it needs: the last row when
the request reaches the end of its tokens (it samples), and the rows whose next token is a
prompt token while it still owes prompt log-probabilities. A request verifying k draft
tokens runs as a chunk of 1 + k tokens at the end of its context and needs all 1 + k rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.engine.attention import (
    AttentionMetadata,
    PagedKVCache,
    PrefillChunk,
    native_decode,
)
from kiln.runtime.engine.model import CausalLM
from kiln.runtime.engine.scheduler import SchedulerOutput
from kiln.runtime.engine.sequence import Request


@dataclass(slots=True)
class StepLogits:
    """The forward's logits and, per request, which of its rows mean what."""

    logits: torch.Tensor
    # Each sample row's token, where every row of the step samples greedily without
    # log-probabilities (the forward then returns argmaxes, not logits; `logits` is empty).
    tokens: torch.Tensor | None
    # (request, first logits row, first position, count) for prompt log-probability rows.
    prompt_rows: list[tuple[Request, int, int, int]]
    # (request, row) for requests that sample a token this step; a request verifying k
    # draft tokens (speculative decoding) owns rows [row, row + k], one per position.
    sample_rows: list[tuple[Request, int]]


class ModelRunner:
    """Owns the model and its paged KV cache; runs one scheduled step at a time."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, greedy_steps: bool = True) -> None:
        self.model = model
        # Whether steps that need only greedy tokens may ask the model for argmaxes (a draft
        # model's runner always needs logits: they are mapped onto the target's vocabulary).
        self.greedy_steps = greedy_steps
        self.cache = cache
        self.block_size = cache.block_size
        self.device = model.device
        # Decided once (the kernel builds on first use, at load rather than mid-request).
        self.native_decode = native_decode(cache)
        # The window of the model's sliding-window layers, if it has any.
        self.window = next((w for i in range(model.config.num_layers)
                            if (w := model.config.layer_window(i))), None)  # fmt: skip

    def run(self, step: SchedulerOutput) -> StepLogits:
        order = sorted(
            range(len(step.requests)), key=lambda i: step.num_new_tokens[i] != 1
        )  # decodes first; sort is stable
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[Request, int, int]] = []
        for i in order:
            request, count = step.requests[i], step.num_new_tokens[i]
            start = request.num_computed_tokens
            if count == 1:
                table = request.block_table
                token_ids.append(request.all_token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_tables.append(table[: start // bs + 1])
                decode_lens.append(start + 1)
            else:
                prefills.append((request, len(token_ids), count))
                token_ids.extend(request.all_token_ids[start : start + count])
                token_ids.extend(request.spec_token_ids)  # draft tokens to verify, if any
                positions.extend(range(start, start + count))
                table = request.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + count))

        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_decodes=len(decode_lens))
        rows: list[int] = []
        sample_rows: list[tuple[Request, int]] = []
        prompt_rows: list[tuple[Request, int, int, int]] = []
        for row, i in enumerate(order[: len(decode_lens)]):
            request = step.requests[i]
            self._plan_rows(request, row, 1, rows, sample_rows, prompt_rows)
        if decode_lens:
            width = max(len(t) for t in decode_tables)
            flat = [b for t in decode_tables for b in t + [0] * (width - len(t))]
            meta.decode_block_ids = self._tensor(flat)
            lens = self._tensor(decode_lens)
            meta.decode_lens = lens
            meta.native_decode = self.native_decode
            if not self.native_decode:
                meta.decode_bias = self._decode_bias(lens, width * bs, None)
        for request, first, count in prefills:
            start = request.num_computed_tokens
            context = start + count
            blocks = self._tensor(request.block_table[: -(-context // bs)])
            # the chunk's queries sit at the end of a longer context
            causal = self._chunk_bias(start, context, None) if start > 0 else None
            meta.prefills.append(PrefillChunk(first, count, context, blocks, causal))
            self._plan_rows(request, first, count, rows, sample_rows, prompt_rows)
        if self.window is not None:
            meta.windowed = self._windowed(meta, decode_lens, self.window)

        args = (self._tensor(token_ids), self._tensor(positions), self.cache, meta)
        if self._greedy_only(prompt_rows, sample_rows):
            tokens = self.model.forward(*args, self._tensor(rows), greedy=True)
            return StepLogits(tokens.new_empty((0,)), tokens, prompt_rows, sample_rows)
        logits = self.model.forward(*args, self._tensor(rows))
        return StepLogits(logits, None, prompt_rows, sample_rows)

    def _windowed(
        self, meta: AttentionMetadata, decode_lens: list[int], window: int
    ) -> AttentionMetadata | None:
        """The step's metadata for sliding-window layers: rows whose context exceeds `window`
        get masks hiding the keys behind it (decodes on the torch path); None where none does."""
        long_decodes = any(n > window for n in decode_lens)
        if not long_decodes and all(c.context_len <= window for c in meta.prefills):
            return None
        out = AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            num_decodes=meta.num_decodes,
            decode_block_ids=meta.decode_block_ids,
            decode_lens=meta.decode_lens,
            native_decode=meta.native_decode and not long_decodes,
            decode_bias=meta.decode_bias,
        )
        if long_decodes:
            assert meta.decode_block_ids is not None and meta.decode_lens is not None
            width = meta.decode_block_ids.numel() // meta.num_decodes * self.block_size
            out.decode_bias = self._decode_bias(meta.decode_lens, width, window)
        for chunk in meta.prefills:
            if chunk.context_len > window:
                start = chunk.context_len - chunk.length
                chunk = PrefillChunk(chunk.start, chunk.length, chunk.context_len,
                                     chunk.block_ids, self._chunk_bias(start, chunk.context_len,
                                                                       window))  # fmt: skip
            out.prefills.append(chunk)
        return out

    def _decode_bias(self, lens: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
        """Additive mask [1, rows, 1, width] hiding each decode row's padding (and, with
        `window`, the keys more than window - 1 positions behind its query)."""
        keys = torch.arange(width, device=self.device).unsqueeze(0)
        hidden = keys >= lens.unsqueeze(1)
        if window is not None:
            hidden |= keys <= lens.unsqueeze(1) - 1 - window
        bias = torch.zeros(hidden.shape, dtype=self.cache.dtype, device=self.device)
        return bias.masked_fill_(hidden, float("-inf")).view(1, len(lens), 1, -1)

    def _chunk_bias(self, start: int, context: int, window: int | None) -> torch.Tensor:
        """Additive mask [context - start, context] for queries at positions [start, context):
        causal, and with `window` hiding keys window or more positions behind each query (as
        transformers' sliding-window mask: key > query - window)."""
        query_pos = torch.arange(start, context, device=self.device).unsqueeze(1)
        keys = torch.arange(context, device=self.device).unsqueeze(0)
        hidden = keys > query_pos
        if window is not None:
            hidden |= keys <= query_pos - window
        causal = torch.zeros(hidden.shape, dtype=self.cache.dtype, device=self.device)
        return causal.masked_fill_(hidden, float("-inf"))

    def _greedy_only(
        self,
        prompt_rows: list[tuple[Request, int, int, int]],
        sample_rows: list[tuple[Request, int]],
    ) -> bool:
        """Whether the step needs only argmaxes: every row samples greedily, with no
        log-probabilities and no draft tokens to verify, and the model screens its head."""
        return (
            self.greedy_steps
            and self.model.greedy_head is not None
            and not prompt_rows
            and bool(sample_rows)
            and all(
                r.params.greedy
                and r.params.logprobs is None
                and not r.spec_token_ids
                and not r.params.processes_logits
                for r, _ in sample_rows
            )
        )

    def _plan_rows(
        self,
        request: Request,
        first: int,
        count: int,
        rows: list[int],
        sample_rows: list[tuple[Request, int]],
        prompt_rows: list[tuple[Request, int, int, int]],
    ) -> None:
        """Record the logits rows this request needs from its chunk [first, first + count)."""
        start = request.num_computed_tokens
        if request.wants_prompt_logprobs:
            # Row for position p predicts token p + 1; entries already held are skipped.
            begin = max(start, len(request.prompt_logprobs) - 1)
            end = min(start + count, request.num_prompt_tokens - 1)
            if end > begin:
                prompt_rows.append((request, len(rows), begin, end - begin))
                rows.extend(range(first + begin - start, first + end - start))
        drafts = len(request.spec_token_ids)
        if start + count == request.num_tokens + drafts:
            sample_rows.append((request, len(rows)))
            rows.extend(range(first + count - 1 - drafts, first + count))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
