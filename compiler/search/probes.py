"""Which k the mixed-precision search judges next: k (the most sensitive groups kept float)
grown 1, 2, 4, … until the gate passes, then bisected down to the smallest k that passes.

`walk` replays that procedure over the outcomes known so far and says the next k it needs,
or its answer. The serial search judges that one k and walks again; a search on a cluster
asks `next_probes` for several: the k the walk needs now, then the ks it would need after
each outcome of those, breadth first, so whichever way they come out, the walk takes exactly
the serial search's steps and reaches its answer. Ours: no library bisects a gate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Walk:
    """Where the search stands: `need` is the next k to judge; with none, `best` is the
    smallest k that passed (None: none did, even at `top`)."""

    need: int | None
    best: int | None = None


def walk(passed: Mapping[int, bool], top: int) -> Walk:
    """Replay the search (k = 1, 2, 4, … capped at `top`, then bisection) over `passed`."""
    k, low = 1, 0
    while True:
        probe = min(k, top)
        if probe not in passed:
            return Walk(probe)
        if passed[probe]:
            break
        if k >= top:
            return Walk(None)
        low, k = probe, min(2 * k, top)
    high = min(k, top)
    while high - low > 1:  # the smallest k that passes lies in (low, high]
        mid = (low + high) // 2
        if mid not in passed:
            return Walk(mid)
        low, high = (low, mid) if passed[mid] else (mid, high)
    return Walk(None, high)


def next_probes(passed: Mapping[int, bool], top: int, width: int) -> list[int]:
    """Up to `width` ks worth judging at once, the one the walk needs now first; empty once
    the walk has its answer."""
    wanted: list[int] = []
    branches: deque[dict[int, bool]] = deque([dict(passed)])
    while branches and len(wanted) < width:
        known = branches.popleft()
        need = walk(known, top).need
        if need is None:
            continue
        if need not in wanted:
            wanted.append(need)
        branches.extend(({**known, need: True}, {**known, need: False}))
    return wanted
