"""Tokenising requests on the server's worker threads, several at once, with a bound known
before any work: a pool of copies of the model's tokenizer (a Rust tokenizer must not see
two encodes at once, so each copy serves one request at a time), and the most bytes one
token can stand for, so a prompt that cannot fit the context is refused on its length in
bytes, before it is tokenised.
"""

from __future__ import annotations

import contextlib
import copy
import queue
from collections.abc import Iterator
from typing import Any

from kiln.runtime.engine.chat import chat_token_ids

POOL_SIZE = 4  # tokenizers; the server's thread pool has more workers than this


def max_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token stands for: the longest entry of
    the vocabulary as stored (byte-level BPE stores each byte as one character of one or two
    bytes, SentencePiece its pieces as text), so n tokens never cover more than n times it."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    longest = max((len(str(piece).encode()) for piece in vocab), default=0)
    return max(longest, 4)  # at least one UTF-8 character


class TokenizerPool:
    """Copies of one tokenizer, lent one request at a time."""

    def __init__(self, tokenizer: Any, size: int = POOL_SIZE, copies: list[Any] | None = None):
        """`size` copies of `tokenizer`, or the given `copies` to lend instead."""
        self.tokenizer = tokenizer  # the original, for what reads but never encodes
        self.max_token_bytes = max_token_bytes(tokenizer)
        self._free: queue.Queue[Any] = queue.Queue()
        for lent in copies or [copy.deepcopy(tokenizer) for _ in range(max(size, 1))]:
            self._free.put(lent)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Any]:
        """A tokenizer no other thread uses until this one gives it back."""
        tokenizer = self._free.get()
        try:
            yield tokenizer
        finally:
            self._free.put(tokenizer)

    def too_long(self, text: str, max_tokens: int) -> bool:
        """Whether `text` certainly tokenises to more than `max_tokens`, judged by its bytes."""
        return len(text.encode(errors="replace")) > max_tokens * self.max_token_bytes

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.borrow() as tokenizer:
            return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        with self.borrow() as tokenizer:
            return str(tokenizer.decode(token_ids, skip_special_tokens=False))

    def chat_ids(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        with self.borrow() as tokenizer:
            return chat_token_ids(tokenizer, messages, add_generation_prompt=add_generation_prompt)
