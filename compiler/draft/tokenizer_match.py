"""Compare two models' tokenizers across GGUF and Hugging Face files.

A draft model for speculative decoding must tokenise exactly like its target: the target
verifies the draft's token ids as its own. No library compares two tokenizers across GGUF
metadata and Hugging Face files, so this is ours: both are read into the same plain form
(tokens by id, BPE merges, special tokens, bos/eos/unk/pad) and compared field by field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.sources.sidecar import FileFacts

TOKENIZER_SIDECAR = "gguf-tokenizers.json"
GGUF_CONTROL = 3  # llama.cpp token type of special (control) tokens
ROLES = ("bos", "eos", "unk", "pad")


@dataclass(frozen=True)
class TokenizerFacts:
    """What decides how text becomes ids: tokens by id, BPE merges, special tokens."""

    tokens: list[str]
    merges: list[str]  # "a b" per merge, in priority order; empty for non-BPE models
    special: list[str]  # special (control) tokens, sorted
    roles: dict[str, str] = field(default_factory=dict)  # bos/eos/unk/pad → token, where set


def tokenizer_facts(ref: sources.SourceRef) -> TokenizerFacts:
    """Read a source's tokenizer from a GGUF's metadata or a Hugging Face directory."""
    if ref.kind in (sources.GGUF, sources.BUILTIN):
        # GGUFReader parses a 49k vocabulary in seconds: remember it per file version.
        known = FileFacts(TOKENIZER_SIDECAR)
        cached = known.get(ref.path)
        if not isinstance(cached, dict):
            cached = dataclasses.asdict(_gguf_facts(ref.path))
            known.put(ref.path, cached)
            known.save()
        return TokenizerFacts(**cached)
    return _hf_facts(ref.path)


def _gguf_facts(path: Path) -> TokenizerFacts:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field_(key: str) -> Any:
        found = reader.get_field(key)
        return None if found is None else found.contents()

    tokens = [str(t) for t in field_("tokenizer.ggml.tokens") or []]
    types = field_("tokenizer.ggml.token_type") or []
    roles = {}
    for role, key in zip(ROLES, ("bos", "eos", "unknown", "padding"), strict=True):
        token_id = field_(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            roles[role] = tokens[int(token_id)]
    special = sorted(t for t, kind in zip(tokens, types, strict=False) if kind == GGUF_CONTROL)
    merges = [str(m) for m in field_("tokenizer.ggml.merges") or []]
    return TokenizerFacts(tokens, merges, special, roles)


def _hf_facts(model_dir: Path) -> TokenizerFacts:
    path = model_dir / "tokenizer.json"
    if path.is_file():
        data = json.loads(path.read_text())
    else:  # a slow tokenizer (vocab.json + merges.txt, or sentencepiece): let transformers convert
        from transformers import AutoTokenizer

        data = json.loads(AutoTokenizer.from_pretrained(model_dir).backend_tokenizer.to_str())
    model = data.get("model", {})
    by_id: dict[int, str] = {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        by_id.update({int(i): str(t) for t, i in vocab.items()})
    else:  # Unigram: [[piece, score], ...] in id order
        by_id.update({i: str(entry[0]) for i, entry in enumerate(vocab)})
    added = data.get("added_tokens") or []
    by_id.update({int(a["id"]): str(a["content"]) for a in added})
    tokens = [by_id.get(i, "") for i in range(max(by_id) + 1)] if by_id else []
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    special = sorted(str(a["content"]) for a in added if a.get("special"))
    roles: dict[str, str] = {}
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    for role in ROLES:
        value = config.get(f"{role}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            roles[role] = value
    return TokenizerFacts(tokens, merges, special, roles)


def tokenizer_differences(
    target: TokenizerFacts, draft: TokenizerFacts, limit: int = 3
) -> list[str]:
    """The first differences between two tokenizers, one line each (empty: they agree)."""
    out: list[str] = []
    if target.tokens != draft.tokens:
        diffs = [
            i
            for i in range(max(len(target.tokens), len(draft.tokens)))
            if _at(target.tokens, i) != _at(draft.tokens, i)
        ]
        shown = ", ".join(
            f"id {i}: {_at(target.tokens, i)!r} vs {_at(draft.tokens, i)!r}" for i in diffs[:limit]
        )
        out.append(
            f"vocabulary: {len(target.tokens)} vs {len(draft.tokens)} tokens, "
            f"{len(diffs)} ids differ ({shown})"
        )
    if target.merges != draft.merges:
        first = next(
            (
                i
                for i in range(max(len(target.merges), len(draft.merges)))
                if _at(target.merges, i) != _at(draft.merges, i)
            ),
            0,
        )
        out.append(
            f"merges: {len(target.merges)} vs {len(draft.merges)}, first difference at "
            f"#{first}: {_at(target.merges, first)!r} vs {_at(draft.merges, first)!r}"
        )
    if set(target.special) != set(draft.special):
        only_t = sorted(set(target.special) - set(draft.special))[:limit]
        only_d = sorted(set(draft.special) - set(target.special))[:limit]
        out.append(f"special tokens: only the target has {only_t}, only the draft has {only_d}")
    for role in ROLES:
        a, b = target.roles.get(role), draft.roles.get(role)
        if a is not None and b is not None and a != b:
            out.append(f"{role}_token: {a!r} vs {b!r}")
    return out


def _at(items: list[str], index: int) -> str | None:
    return items[index] if index < len(items) else None
