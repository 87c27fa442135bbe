"""Incremental detokenisation and stop-string detection.

Decoding one token at a time is wrong for byte-level BPE (a character may span tokens) and
for SentencePiece (a token's leading space depends on its left neighbour), so each step
decodes a short window of tokens twice, with and without the new ones, and emits the
difference once it no longer ends in an incomplete character. Hand-written because the
tokenizers library offers no streaming decoder for arbitrary vocabularies; the approach is
the one vLLM and Hugging Face's TextStreamer use.
"""

from __future__ import annotations

import threading
from typing import Any

from kiln.runtime.engine.sequence import Request

# Prompt tokens decoded as left context for the first output token.
CONTEXT_TOKENS = 5


class Detokenizer:
    """Appends each request's newly decodable text to `request.text`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust tokenizer skips transformers' Python wrapper: ~10x cheaper per call.
        self._decode = backend.decode if backend is not None else tokenizer.decode
        # transformers' encode briefly reconfigures the Rust tokenizer; decoding on the engine
        # thread at that moment fails with "Already borrowed", so the two take turns.
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            return self._decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included)."""
        return [self.decode([token], skip_special_tokens=False) for token in token_ids]

    def start(self, request: Request) -> None:
        request.read_offset = request.num_prompt_tokens
        request.prefix_offset = max(request.read_offset - CONTEXT_TOKENS, 0)

    def step(self, request: Request) -> str:
        """Decode the request's newest tokens; returns the text added to `request.text`."""
        ids = request.all_token_ids
        skip = request.params.skip_special_tokens
        prefix = self.decode(ids[request.prefix_offset : request.read_offset], skip)
        full = self.decode(ids[request.prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)
        request.text += delta
        return delta


def find_stop(request: Request, delta: str) -> bool:
    """Cut `request.text` at the first stop string that the new text completes."""
    stops = request.params.stop
    if not stops or not delta:
        return False
    text = request.text
    hits = []
    for stop in stops:
        at = text.find(stop, max(len(text) - len(delta) - len(stop) + 1, 0))
        if at >= 0:
            hits.append((at, stop))
    if not hits:
        return False
    at, stop = min(hits)
    keep = at + len(stop) if request.params.include_stop_str_in_output else at
    request.text = text[:keep]
    request.stop_reason = stop
    return True
