"""One candidate judged: its recipe compiled and gated exactly as `kiln compile` would, with
the early look first (search/early.py) and, when asked, kiln's runtime timed on this machine.
The serial search (run.py) and each worker of a search on a cluster (search/cluster/) call
`judge_candidate`, so both give a candidate the same verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kiln.compiler.compile import compile_recipe
from kiln.compiler.gating import gate_compiled
from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.search.early import decided_fail, screen_recipe
from kiln.compiler.search.pareto import quality_of
from kiln.compiler.search.settings import SearchSettings
from kiln.compiler.search.state import Judged
from kiln.gates.releases import Registry
from kiln.runtime.base.errors import KilnError, disk_full

Progress = Callable[[str], None]


def judge_candidate(
    judged: Judged, settings: SearchSettings, registry: str | None, say: Progress
) -> Judged:
    """Compile and gate one candidate from its recipe (`judged.recipe`, written) as `kiln
    compile` would; a recipe kiln refuses is recorded as refused. The serial search calls
    this, and so does each worker of a search on a cluster (search/cluster/)."""
    try:
        return _compile_and_gate(judged, Path(judged.recipe), settings, registry, say)
    except KilnError as exc:  # a recipe kiln refuses: recorded, the search goes on
        if disk_full(exc) is not None:
            raise  # every later candidate would fail the same way: the search stops, saying so
        judged.refused = " ".join(str(exc).split())[:600]
        return judged


def _compile_and_gate(
    judged: Judged, path: Path, settings: SearchSettings, registry_spec: str | None, say: Progress
) -> Judged:
    cand = judged.candidate
    say(f"{cand.id}: compiling")
    recipe = load_recipe(path)
    result = compile_recipe(path, progress=lambda text: say(f"{cand.id}: {text}"))
    judged.artifact = str(result.artifact)
    with Registry(registry_spec) as registry:
        screen = screen_recipe(recipe) if settings.early_stop else None
        if screen is not None:
            say(f"{cand.id}: early look")
            step = gate_compiled(result, screen, registry=registry)
            assert step is not None
            if decided_fail(step.verdict):
                judged.screen = {"failed": True, "checks": step.failed_checks}
                judged.quality = quality_of(step.verdict, screened_out=True)
                return judged
            judged.screen = {"failed": False}
        say(f"{cand.id}: gating")
        step = gate_compiled(result, recipe, registry=registry)
        assert step is not None
        judged.quality = quality_of(step.verdict)
    if settings.measure:
        judged.measured_tokens_per_s = _measure_decode(result.artifact / "model")
    return judged


def _measure_decode(model_dir: Path, tokens: int = 32) -> float:
    """kiln's runtime decode tokens/s on this machine, one greedy sequence."""
    from kiln.runtime import Engine, SamplingParams

    engine = Engine.from_pretrained(model_dir)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    began = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    return len(out.token_ids) / (time.perf_counter() - began)
