"""Every .jsonl kiln reads reports a bad line the same way: FILE:LINE and what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.runtime.base.jsonlines import json_objects


class Bad(Exception):
    pass


def test_objects_come_with_their_line_numbers_and_blank_lines_are_skipped(tmp_path: Path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n\n  \n{"text": "two"}\n')
    assert list(json_objects(path, Bad)) == [(1, {"text": "one"}), (4, {"text": "two"})]


@pytest.mark.parametrize(
    ("content", "line", "problem"),
    [
        (b'{"a": 1}\n\xff\xfe binary\n', 2, "not UTF-8 text"),
        (b'{"a": 1}\n{"a": "\x00"}\n', 2, "not UTF-8 text (a NUL byte)"),
        (b'{"a": 1}\n\n{not json\n', 3, "not valid JSON"),
        (b"[1, 2]\n", 1, "expected a JSON object, got list"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, content: bytes, line: int, problem: str) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(content)
    with pytest.raises(
        Bad, match=rf"^{path}:{line}: {problem}".replace("(", r"\(").replace(")", r"\)")
    ):
        list(json_objects(path, Bad))
