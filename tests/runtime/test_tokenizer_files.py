"""A tokenizer kiln saves carries no trace of how this process loaded it."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from kiln.runtime.formats.tokenizer_files import LOAD_TIME_KEYS, save_tokenizer


def test_a_saved_tokenizer_config_holds_no_load_time_keys(tiny_llama: Path, tmp_path: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    save_tokenizer(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert not set(LOAD_TIME_KEYS) & set(config)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("hello world") == tokenizer.encode(
        "hello world"
    )
