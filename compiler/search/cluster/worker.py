"""What runs on a worker: one candidate judged (search/judge.py), returned as its row with
the node it ran on, when it started, how long it took and which attempt it was. Each attempt
notes itself in the search directory first (`candidates/.<id>.attempts`), so a retry after a
worker died knows it is the second, and the driver can say where a candidate runs."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln.compiler.search.judge import judge_candidate
from kiln.compiler.search.settings import SearchSettings
from kiln.compiler.search.state import Judged


def attempts_file(search_dir: Path, cid: str) -> Path:
    """Where each attempt at candidate `cid` notes its node, process id and start."""
    return search_dir / "candidates" / f".{cid}.attempts"


def attempts(path: Path) -> list[dict[str, Any]]:
    """The attempts noted in `path` (none when it is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def judge_on_worker(job: dict[str, Any]) -> dict[str, Any]:
    """A Ray task: judge the candidate in `job` (its row so far, the search settings, the
    registry, its attempts file) and return its row."""
    import ray

    began = time.monotonic()
    started = datetime.now(UTC).isoformat(timespec="seconds")
    node = f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    noted = Path(job["attempts"])
    with noted.open("a") as f:
        f.write(json.dumps({"node": node, "pid": os.getpid(), "started": started}) + "\n")
    judged = Judged.from_dict(job["judged"])
    cid, attempt = judged.candidate.id, len(attempts(noted))

    def say(text: str) -> None:  # the worker's log; the driver prints progress of its own
        print(f"kiln search: {text}", file=sys.stderr, flush=True)

    say(f"{cid}: attempt {attempt} on {node}")
    judged = judge_candidate(judged, SearchSettings(**job["settings"]), job["registry"], say)
    judged.seconds = time.monotonic() - began
    judged.node, judged.started, judged.attempts = node, started, attempt
    return judged.to_dict()
