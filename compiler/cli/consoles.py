"""The rich Consoles `kiln` commands print through, built in one place.

Where the stream is not a terminal (a pipe, a CI log, `| grep`), a line is never wrapped:
rich would otherwise break every line at 80 columns (or $COLUMNS), splitting a path or a
problem line in two. Built when a command runs, not at import, so they see the streams of
that run.
"""

from __future__ import annotations

from rich.console import Console

# Columns a console takes where its stream is no terminal: more than any line kiln prints, so
# tables size to their content and nothing wraps.
UNWRAPPED = 100_000


def console(stderr: bool = False) -> Console:
    """A Console on stdout (or stderr) that wraps to the terminal's width on a terminal, and
    not at all elsewhere."""
    found = Console(stderr=stderr, highlight=False)
    if found.is_terminal:
        return found
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=UNWRAPPED)
