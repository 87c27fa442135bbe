"""The held-out text the gate measures next-token KL and top-1 agreement on.

By default kiln's own offline text, in order: `kiln_ppl`'s documents, then `kiln_cloze`'s
passages (context and its next word); neither is calibration data. Texts are cut to
`divergence.max_seq_len` tokens and taken until `divergence.tokens` next-token positions
are scored (10,240 by default), so a KL mean rests on enough tokens to mean something.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kiln.gates.measure.tasks import BUILTIN_TASKS_DIR
from kiln.runtime.base.errors import UsageError


def resolve_path(path: str | None, base_dir: Path) -> Path | None:
    """A gate file's path setting: absolute, or relative to `base_dir` (None stays None)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return p if p.is_absolute() else base_dir / p


# The built-in held-out text for KL, in order: neither is calibration data.
BUILTIN_DIVERGENCE_TEXTS = ("kiln_ppl.jsonl", "kiln_cloze.jsonl")


def _read_texts(path: Path) -> list[str]:
    """A .jsonl file's texts ("text", else "context" and "target" joined), or a plain text
    file's paragraphs."""
    if path.suffix != ".jsonl":
        return [p for p in path.read_text().split("\n\n") if p.strip()]
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(str(row["text"] if "text" in row else f"{row['context']} {row['target']}"))
    return texts


def divergence_texts(texts_file: str | None, num_texts: int | None, base_dir: Path) -> list[str]:
    """Held-out texts for next-token KL, in order: `texts_file` (gates.divergence.texts,
    relative to `base_dir`) or the built-in ones; at most `num_texts` when set."""
    given = resolve_path(texts_file, base_dir)
    paths = [given] if given else [BUILTIN_TASKS_DIR / name for name in BUILTIN_DIVERGENCE_TEXTS]
    texts = []
    for path in paths:
        if not path.is_file():
            raise UsageError(f"gates.divergence.texts: {path} not found")
        texts += _read_texts(path)
    return texts[:num_texts]


def divergence_ids(
    texts: list[str], encode: Callable[[str], list[int]], tokens: int, max_seq_len: int
) -> list[list[int]]:
    """Token ids of the texts KL is measured on: each cut to `max_seq_len`, taken in order
    until `tokens` next-token positions are scored (a text of n tokens scores n - 1)."""
    chosen: list[list[int]] = []
    scored = 0
    for text in texts:
        if scored >= tokens:
            break
        ids = encode(text)[:max_seq_len]
        if len(ids) > 1:
            chosen.append(ids)
            scored += len(ids) - 1
    return chosen
