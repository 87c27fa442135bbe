"""A tokenizer saved into a checkpoint kiln writes: its files, less what says how this process
loaded it. transformers 5 writes `local_files_only` (which follows $HF_HUB_OFFLINE as it was
read at import) and `is_local` into tokenizer_config.json, so the same tokenizer saved from two
processes made two artifacts of one recipe differ; neither is the tokenizer's content."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LOAD_TIME_KEYS = ("local_files_only", "is_local")
CONFIG = "tokenizer_config.json"


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """`tokenizer.save_pretrained(out)` without LOAD_TIME_KEYS in its config."""
    tokenizer.save_pretrained(out)
    path = Path(out) / CONFIG
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if any(key in config for key in LOAD_TIME_KEYS):
        kept = {k: v for k, v in config.items() if k not in LOAD_TIME_KEYS}
        path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
