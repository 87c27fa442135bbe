"""The watch a serving engine kiln starts runs under: `python engine_watch.py PARENT_PID --
ENGINE ARGV...` runs the engine as its child, in the process group kiln gave it, and ends the
whole group when kiln ends, however kiln ends.

kiln starts each engine in a session of its own (so a terminal's Ctrl-C reaches kiln, which
stops it in order), and stops it on exit, SIGTERM and SIGINT. A `kill -9` of kiln runs none of
that: without this watch the engine would go on serving. The watch polls its parent; when
kiln is gone it sends SIGTERM to the group (the engine and any workers it started), then
SIGKILL after a grace period. While kiln lives, the watch leaves SIGTERM to the engine
(kiln's own stop signals the whole group) and exits with the engine's status.

Standard library only, and run by its path: it must start in milliseconds beside an engine
whose start takes seconds, and import none of kiln.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

POLL_S = 0.2
GRACE_S = 30.0


def _end_group(engine: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the whole group, SIGKILL after GRACE_S (the watch goes with it)."""
    group = os.getpgid(0)
    os.killpg(group, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        engine.wait(GRACE_S)
    os.killpg(group, signal.SIGKILL)
    return 128 + signal.SIGKILL


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: engine_watch.py PARENT_PID -- ENGINE ARGV...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    engine = subprocess.Popen(argv[2:])
    # kiln's stop sends SIGTERM to the group: the engine shuts down, the watch waits for it.
    # (Ignored only after the engine started: an ignored signal stays ignored across exec.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            code = engine.wait(POLL_S)
            return code if code >= 0 else 128 - code
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # kiln is gone: its child was re-parented
            return _end_group(engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
