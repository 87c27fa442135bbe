"""One side's answer to one request: what the gate's shadow comparison reads.

The gate's replay gets answers from endpoints and engines (gates/measure/sides.py), and
`kiln serve --mirror` logs the primary's and the candidate's (formats/mirror_log.py).
Standard library only: the gate reads mirror logs without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SideAnswer:
    """One side's answer to one request; `error` set means it failed to answer. `model` and
    `digest` name the side where a log keeps the answers of two."""

    text: str = ""
    token_ids: list[int] | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    model: str = ""
    digest: str = ""
