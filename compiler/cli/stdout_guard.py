"""Keep stdout for kiln's one JSON object while the libraries it drives are working.

`kiln compile --json` is parsed by CI scripts, but ModelOpt reports calibration progress with
`print()`, and native code may write to file descriptor 1 directly. While the guard is held,
both the Python stream and descriptor 1 lead to stderr; kiln writes its JSON after the guard is
released. Hand-written: `contextlib.redirect_stdout` covers only Python-level writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator


def _flush_c_stdio() -> None:
    """Flush the C library's stdio buffers, so native text lands where it was written."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send everything written to stdout to stderr until the block ends (no-op when disabled)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    _flush_c_stdio()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)
