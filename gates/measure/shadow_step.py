"""The gate's shadow step: recorded traffic replayed through the candidate and the baseline.

A model baseline is also replayed against its shadow control (the baseline's own weights
computed at another precision), the noise floor of greedy exact match. The baseline's and
the control's answers are cached (gates/measure/replay_cache.py), so a second gate against the same
baseline replays only the candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.gates.measure.eval_cache import EvaluationCache
from kiln.gates.measure.noise_floor import engine_dtype
from kiln.gates.measure.replay import ReplaySettings, Side, replay
from kiln.gates.measure.replay_cache import CachedSide, replay_key
from kiln.gates.measure.shadow import ShadowReport
from kiln.gates.measure.sides import EngineSide, HttpSide, SideSpec
from kiln.runtime.formats.traffic import TrafficRecord

Progress = Callable[[str], None]


def replay_side(side: SideSpec, engine: Any, timeout_s: float) -> Side:
    if side.kind == "http":
        assert side.url is not None
        return HttpSide(side.url, timeout_s=timeout_s)
    if engine is not None:
        return EngineSide(engine, side.name)
    return EngineSide.load(side)


def _served_dtype(side: SideSpec, engine: Any) -> str:
    """The compute dtype a model side is (or would be) served in by the runtime's "auto"."""
    if engine is not None:
        return engine_dtype(engine)
    import torch

    from kiln.runtime.engine.dtype import choose_dtype
    from kiln.runtime.formats.artifact import MODEL_DIR
    from kiln.runtime.formats.checkpoint.files import read_config

    assert side.path is not None
    model_dir = side.path / MODEL_DIR if side.kind == "artifact" else side.path
    return choose_dtype("auto", read_config(model_dir), torch.device("cpu")).name


def _model_side(
    side: SideSpec, role: str, dtype: str, load: Callable[[], Side], shadow: ShadowSetup
) -> CachedSide:
    """A model side's replay answers, cached under its digest, the traffic and the dtype."""
    key = replay_key(side.digest, role, shadow.traffic, shadow.settings, dtype)
    return CachedSide(side.name, load, shadow.cache, key, fresh=role in shadow.fresh)


@dataclass(slots=True)
class ShadowSetup:
    """What the shadow step replays and how its model sides' answers are cached."""

    records: list[TrafficRecord]
    traffic: Path
    settings: ReplaySettings
    cache: EvaluationCache | None
    fresh: set[str]  # roles whose cached answers are not used (replayed again)
    timeout_s: float  # per request, each side
    control: bool  # whether a model baseline is replayed against its control too


def shadow_step(
    cand: SideSpec,
    base: SideSpec,
    engines: tuple[Any, Any],
    setup: ShadowSetup,
    notes: list[str],
    say: Progress,
) -> ShadowReport:
    """Replay the traffic through the candidate and the baseline, and (for a model baseline)
    the baseline against its control: the baseline's own weights computed at another
    precision (float32 if it serves in 16 bits, else bfloat16), the shadow noise floor.
    The baseline's and the control's answers come from the cache where it holds them."""
    cand_engine, base_engine = engines
    timeout = setup.timeout_s
    base_side: Side
    served = ""
    if base.kind == "http":
        base_side = replay_side(base, None, timeout)
    else:
        served = _served_dtype(base, base_engine)
        base_side = _model_side(
            base, "shadow-baseline", served,
            lambda: replay_side(base, base_engine, timeout), setup,
        )  # fmt: skip
    say(f"replay: {len(setup.records)} recorded requests through both sides")
    shadow = replay(
        setup.records,
        base_side,
        replay_side(cand, cand_engine, timeout),
        setup.settings,
        progress=say,
    )
    if not isinstance(base_side, CachedSide):
        return shadow
    if setup.control:
        dtype = "bfloat16" if served == "float32" else "float32"
        control = _model_side(
            base, "shadow-control", dtype, lambda: EngineSide.load(base, dtype=dtype), setup
        )
        say(f"replay: the control, the baseline computed in {dtype} (the noise floor)")
        floor = replay(setup.records, base_side, control, setup.settings)
        shadow.control = f"the baseline computed in {dtype}"
        shadow.control_exact_match_rate = floor.exact_match_rate
        control.save()
        if control.cached:
            say(f"replay: the control's {control.cached} answers from the cache")
    base_side.save()
    if base_side.cached:
        say(f"replay: the baseline's {base_side.cached} answers from the cache")
        notes.append(
            f"shadow: the baseline's answers to the {base_side.cached} requests came from the "
            "evaluation cache; its TTFT/TPOT were measured when they were computed, under that "
            "run's machine load, so the timing ratios are reported only (a gated timing "
            "ratio replays the baseline again)"
        )
    return shadow
