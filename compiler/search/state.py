"""A search's `state.json`: each candidate's outcome, written as soon as it is known, so a
killed search resumes from the candidates it finished.

The state is keyed by everything that decides a verdict: the recipe's resolved content (its
gates, and what it `extends:`), the search settings that make or judge the candidates, and
the versions of the tools that shape an artifact or a gate's numbers. A rerun under another
key judges every candidate afresh, saying what changed, and keeps the old state beside the
new one: resuming verdicts that the changed recipe or tools would not give is the one thing
a search must never do. Ours: no library keeps a search's state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.search.pareto import Quality
from kiln.compiler.search.price import Price
from kiln.compiler.search.space import Candidate
from kiln.runtime.base.atomic import replace_text
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.versions import COMPILE_TOOLS, GATE_TOOLS, versions

STATE = "state.json"
TOOLS = tuple(dict.fromkeys((*COMPILE_TOOLS, *GATE_TOOLS)))
# Recipe keys no verdict depends on: the search's own section (its verdict settings are
# keyed above, as the command line resolved them) and where the recipe's artifacts go.
NOT_DECIDING = ("search", "output")


@dataclass
class Judged:
    """One candidate's outcome: its recipe, artifact, gate quality and prices."""

    candidate: Candidate
    recipe: str
    artifact: str | None = None
    quality: Quality | None = None
    prices: dict[str, Price] = field(default_factory=dict)
    refused: str | None = None  # compile refused it: the message
    seconds: float = 0.0
    measured_tokens_per_s: float | None = None
    screen: dict[str, Any] | None = None  # the early look's verdict summary
    # On a cluster (search/cluster/): the node and UTC time its last attempt started, how
    # many attempts it took, and why it has no verdict when its workers died.
    node: str | None = None
    started: str | None = None
    attempts: int | None = None
    failed: str | None = None

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "id": c.id,
            "kind": c.kind,
            "scheme": c.scheme_name,
            "parent": c.parent,
            "kept_float": c.kept_float,
            "targets": c.targets,
            "quantization": c.quantization,
            "recipe": self.recipe,
            "artifact": self.artifact,
            "refused": self.refused,
            "seconds": round(self.seconds, 1),
            "quality": self.quality.to_dict() if self.quality else None,
            "prices": {t: p.to_dict() for t, p in self.prices.items()},
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "screen": self.screen,
            "node": self.node,
            "started": self.started,
            "attempts": self.attempts,
            "failed": self.failed,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judged:
        cand = Candidate(
            data["id"],
            data["scheme"],
            data["quantization"],
            data["kind"],
            data.get("kept_float") or [],
            data.get("parent"),
            data.get("targets") or [],
        )
        q = data.get("quality")
        prices = {
            t: Price(**{k: v for k, v in p.items() if k != "source"})
            for t, p in data.get("prices", {}).items()
        }
        for name, value in (("quality", Quality(**q) if q else None), *prices.items()):
            if value is not None:
                _typed(value, f"{data['id']}'s {name}")
        return cls(
            cand,
            data["recipe"],
            data.get("artifact"),
            Quality(**q) if q else None,
            prices,
            data.get("refused"),
            data.get("seconds", 0.0),
            data.get("measured_tokens_per_s"),
            data.get("screen"),
            data.get("node"),
            data.get("started"),
            data.get("attempts"),
            data.get("failed"),
        )

    @property
    def passed(self) -> bool:
        return self.quality is not None and self.quality.passed


def _typed(record: Any, where: str) -> None:
    """ValueError naming the field of `record` (a Quality or Price read back from a state)
    that does not hold its declared kind: a verdict resumed from a number that is NaN, or a
    string where a flag belongs, would be a verdict no gate gave."""
    for f in dataclasses.fields(record):
        value, kinds = getattr(record, f.name), str(f.type).replace(" ", "").split("|")
        ok = (
            (value is None and "None" in kinds)
            or (isinstance(value, bool) and "bool" in kinds)
            or (isinstance(value, str) and "str" in kinds)
            or (
                isinstance(value, list)
                and "list[str]" in kinds
                and all(isinstance(v, str) for v in value)
            )
            or (
                not isinstance(value, bool)
                and isinstance(value, int | float)
                and ("float" in kinds or ("int" in kinds and isinstance(value, int)))
                and math.isfinite(value)
            )
        )
        if not ok:
            raise ValueError(f"{where}.{f.name} is {value!r}, not a {f.type} a gate gives")


def state_key(recipe: Recipe, search: dict[str, Any]) -> dict[str, Any]:
    """What decides every verdict of a search of `recipe` with the verdict settings `search`."""
    resolved = {k: v for k, v in recipe.resolved().items() if k not in NOT_DECIDING}
    return {"recipe": resolved, "search": search, "tools": versions(TOOLS)}


def what_changed(old: Any, new: dict[str, Any]) -> str | None:
    """What differs between the key a state was written under and `new`, in words (None:
    nothing)."""
    if not isinstance(old, dict):
        return "it was written by an earlier kiln, without a key"
    out = []
    for part, label in (("recipe", "the recipe's {}:"), ("search", "search setting {}")):
        was, now = old.get(part) or {}, new[part]
        out += [label.format(k) for k in sorted({*was, *now}) if was.get(k) != now.get(k)]
    was, now = old.get("tools") or {}, new["tools"]
    out += [
        f"{tool} {was.get(tool, 'absent')} → {now.get(tool, 'absent')}"
        for tool in sorted({*was, *now})
        if was.get(tool) != now.get(tool)
    ]
    return f"{', '.join(out)} changed since it was written" if out else None


def read_state(out_dir: Path, recipe: Path, key: dict[str, Any]) -> tuple[list[Judged], str | None]:
    """The candidates a state in `out_dir` holds for `recipe` under `key`, or, when the
    state was written under another key, none and what changed. A state of another recipe,
    or one kiln cannot read, is a usage error naming the file and the fix."""
    path = out_dir / STATE
    if not os.path.lexists(path):
        return [], None
    fix = f"delete {path} to search afresh, or give another --output"
    if not path.is_file():
        raise UsageError(f"{path}: is not a file, so cannot be a kiln search state; {fix}")
    try:
        data = json.loads(path.read_text())
        owner, rows = data.get("recipe"), [Judged.from_dict(r) for r in data["candidates"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise UsageError(f"{path}: cannot be read as a kiln search state ({why}); {fix}") from None
    if owner != str(recipe):
        raise UsageError(
            f"{path}: is the state of a search of {owner}, not of {recipe}; give another "
            "--output for this recipe"
        )
    changed = what_changed(data.get("key"), key)
    return ([] if changed else rows), changed


def set_aside(out_dir: Path) -> Path:
    """Move a state that is not resumed out of the way, named by its content."""
    path = out_dir / STATE
    aside = out_dir / f"state-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}.json"
    os.replace(path, aside)
    return aside


def write_state(out_dir: Path, recipe: Path, key: dict[str, Any], judged: list[Judged]) -> None:
    """Write the state at once, never half-written."""
    data = {"recipe": str(recipe), "key": key, "candidates": [j.to_dict() for j in judged]}
    replace_text(out_dir / STATE, json.dumps(data, indent=2) + "\n")
