"""One GPU target as preflight resolves it, once: the capacity plan (tp, memory, KV, cost)
and, per TensorRT-LLM path, what stops the resolved scheme there. Deploy and the engine
build read this instead of checking the scheme again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.trtllm.capacity import DeploySpec, Plan, plan
from kiln.compiler.trtllm.rules.support import check_target, path_problems
from kiln.compiler.trtllm.targets import PATHS, PROFILES, TargetProfile
from kiln.quant.registry import Problem
from kiln.quant.spec import Scheme
from kiln.runtime.formats.model_info import ModelInfo


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """A target of the recipe: its profile, capacity plan and each path's problems."""

    profile: TargetProfile
    capacity: Plan
    engine_problems: tuple[Problem, ...]  # the engine path (TensorRT-LLM 1.2.x trtllm-build)
    pytorch_problems: tuple[Problem, ...]  # the PyTorch path (trtllm-serve)

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def tp_size(self) -> int:
        return self.capacity.tp_size


# `deploy.trtllm_path` (engine, pytorch, or both: stopped only where neither path runs it)
# → what stops the scheme there
Support = dict[str, tuple[Problem, ...]]


def target_support(scheme: Scheme, name: str, info: ModelInfo | None = None) -> Support:
    """What stops `scheme` on the known GPU target `name`, per `deploy.trtllm_path` value:
    the one support check of a recipe's targets, made in preflight. With the model's `info`,
    a path that cannot deploy its family is stopped too; `both` then needs the other path."""
    support = {path: tuple(check_target(scheme, name, path=path)) for path in ("both", *PATHS)}
    if info is None or name not in PROFILES:
        return support
    blocked = {p: why for p, why in path_problems(info, scheme).items() if why is not None}
    for p, why in blocked.items():
        support[p] = (why, *support[p])
    if len(blocked) == len(PATHS):
        support["both"] = tuple(dict.fromkeys((*support["engine"], *support["pytorch"])))
    elif blocked:  # the other path must run it; if it cannot either, say why for both
        (other,) = (p for p in PATHS if p not in blocked)
        found = tuple(dict.fromkeys((*support["both"], *support[other])))
        support["both"] = (*blocked.values(), *found) if found else ()
    return support


def plan_target(
    info: ModelInfo, scheme: Scheme, name: str, deploy: DeploySpec, support: Support
) -> TargetPlan:
    """Plan `info` quantised with `scheme` on the known GPU target `name`, whose `support`
    was checked already (UsageError where `deploy` cannot split the model)."""
    return TargetPlan(
        PROFILES[name], plan(info, scheme, PROFILES[name], deploy), support["engine"],
        support["pytorch"],
    )  # fmt: skip
