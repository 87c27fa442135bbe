"""Reading JSON-lines files (recorded traffic, calibration sets) with errors that name file:line.

One reader for every `.jsonl` kiln takes, so a binary file, a broken line or a line that is not
an object is reported the same way wherever it is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.runtime.base.files import ErrorType, open_regular


def json_objects(path: Path, error: ErrorType) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of `path`.

    Raises `error("FILE:LINE: problem")` for a line that is not UTF-8 text (or holds a NUL
    byte: a binary file), is not valid JSON, or is not a JSON object.
    """
    with open_regular(path, error) as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 1]
                raise error(f"{where}: not UTF-8 text (byte {bad!r}); a binary file?") from None
            if "\0" in line:
                raise error(f"{where}: not UTF-8 text (a NUL byte); a binary file?")
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict):
                raise error(f"{where}: expected a JSON object, got {type(data).__name__}")
            yield number, data
