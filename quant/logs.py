"""Keep library logging off stdout, so `kiln ... --json` prints exactly one JSON object.

llm-compressor and compressed-tensors configure loguru at import time with a sink bound to
the `sys.stdout` object of that moment. `route_library_logs_to_stderr` replaces every loguru
sink with one that looks `sys.stderr` up at each write, so it follows redirections (the CLI,
test runners) instead of holding a stream that may since have been closed.
"""

from __future__ import annotations

import contextlib
import os
import sys

FORMAT = "{time:HH:mm:ss} | {name} | {level} - {message}\n"


def _to_stderr(message: object) -> None:
    sys.stderr.write(str(message))


def route_library_logs_to_stderr() -> None:
    """Import the quantisation libraries' loggers, then send loguru to stderr at WARNING.

    KILN_LIBRARY_LOG_LEVEL (e.g. INFO) shows more of what the libraries say.
    """
    # Importing llm-compressor configures loguru and may already log: keep that off stdout.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import llmcompressor  # noqa: F401  (its import adds a stdout sink; replaced below)
            from loguru import logger
        except ImportError:
            return
    logger.remove()
    logger.add(_to_stderr, level=os.getenv("KILN_LIBRARY_LOG_LEVEL", "WARNING"), format=FORMAT)
