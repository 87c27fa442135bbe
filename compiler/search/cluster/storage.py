"""The storage a search on a Ray cluster shares, checked from the workers, and the float
source stage made once for every candidate.

Each node that can run a candidate runs one small task that says what it sees at the paths
the candidates read and write: a token file written just now in the search directory and
in the registry's folder (the same storage, not a node-local directory of the same name),
the recipe and every file it extends, the calibration text files and the source checkpoint
(the same size, and for a small file the same bytes), and the versions of the tools that
shape an artifact or a gate. Anything it sees otherwise is a usage error naming the path and
the node. Ours: Ray checks no filesystem.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.search.cluster.look import fingerprint, what_a_node_sees
from kiln.compiler.search.run import Search
from kiln.compiler.search.state import TOOLS
from kiln.compiler.stages import CACHE_DIR, StageCache, StageResult, input_key, output_lock
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.versions import versions

PROBE_TIMEOUT_S = 300.0  # a cold node starts a worker process first
DOCS = "docs/search.md, 'On a Ray cluster'"


def shared_paths(search: Search) -> list[Path]:
    """What every worker must see as the driver does, beside the two token files."""
    recipe = search.recipe
    paths = [*recipe.files, search.source.path]
    for spec in (recipe.calibration_spec(), recipe.report_spec()):
        name = spec.dataset.removeprefix("traffic:")
        if not name.startswith("builtin:"):
            path = Path(spec.base_dir) / name
            if path.is_file():
                paths.append(path)
    return list(dict.fromkeys(p.resolve() for p in paths))


def check_storage(ray: Any, search: Search, registry: Path, nodes: list[dict[str, Any]]) -> None:
    """Refuse (UsageError naming the path and the node) unless every node in `nodes` sees
    the search directory, the registry's folder, the recipe, its data and the source
    checkpoint as this driver does, and runs the same tool versions."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    registry.parent.mkdir(parents=True, exist_ok=True)
    tokens = [
        folder / f".kiln-probe-{secrets.token_hex(8)}" for folder in (search.dir, registry.parent)
    ]
    for token in tokens:
        token.write_text(secrets.token_hex(16))
    try:
        expected = {str(p): fingerprint(str(p)) for p in [*tokens, *shared_paths(search)]}
        look = ray.remote(what_a_node_sees)
        refs = [
            look.options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote(list(expected), list(TOOLS))
            for n in nodes
        ]
        try:
            seen = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise UsageError(
                f"no worker of the Ray cluster answered within {PROBE_TIMEOUT_S:.0f} s whether it "
                f"sees {search.dir}; check the cluster's nodes (`ray status`)"
            ) from None
    finally:
        for token in tokens:
            token.unlink(missing_ok=True)
    here = versions(TOOLS)
    problems = []
    for node in seen:
        where, saw = node["node"], node["paths"]
        for path, fp in expected.items():
            if saw[path] == fp:
                continue
            if Path(path) in tokens:
                problems.append(
                    f"the worker on {where} does not see {Path(path).parent} as this driver "
                    "does (a file written there just now is not there)"
                )
            else:
                problems.append(
                    f"the worker on {where} sees {saw[path]} at {path}, where this driver sees {fp}"
                )
        tools = node["tools"]
        differ = [
            f"{t} {tools.get(t, 'absent')} (here {here.get(t, 'absent')})"
            for t in sorted({*here, *tools})
            if here.get(t) != tools.get(t)
        ]
        if differ:
            problems.append(f"the worker on {where} runs {', '.join(differ)}")
    if problems:
        raise UsageError(
            "kiln search --ray needs every node to share the search's storage at the same "
            f"paths and to run the same tools: {'; '.join(problems)}; mount them where the "
            f"driver has them (or give --output / --registry on the shared filesystem), "
            f"install the same kiln on every node; see {DOCS}"
        )


def make_source_stage(search: Search) -> StageResult:
    """The float source stage in the search's shared stage cache (`artifacts/`), made now,
    once, for each candidate's own cache to hard-link in: the stage `kiln compile` makes
    first (compiler/pipeline.py `build_model`: the same name, key and record). Were the two
    ever to differ, each candidate would make its own source stage: slower, never wrong."""
    root = search.dir / "artifacts"
    ref = search.source
    with output_lock(root):
        cache = StageCache(root / CACHE_DIR)
        key = input_key("source", sources.source_digest(ref))

        def run_source(out: Path) -> dict[str, Any]:
            model = sources.float_checkpoint(ref, out / "model")
            return {
                "model_dir": str(model.relative_to(out) if model.is_relative_to(out) else model)
            }

        return cache.run("source", key, run_source)
