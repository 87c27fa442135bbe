"""One GPU target as preflight resolves it, once: the capacity plan (tp, memory, KV, cost)
and, per TensorRT-LLM path, what stops the resolved scheme there. Deploy and the engine
build read this instead of checking the scheme again.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.trtllm.capacity import DeploySpec, Plan, plan
from kiln.compiler.trtllm.rules.support import check_target
from kiln.compiler.trtllm.targets import PROFILES, TargetProfile
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


def plan_target(info: ModelInfo, scheme: Scheme, name: str, deploy: DeploySpec) -> TargetPlan:
    """Plan `info` quantised with `scheme` on the known GPU target `name` (UsageError where
    `deploy` cannot split the model)."""
    return TargetPlan(
        PROFILES[name],
        plan(info, scheme, PROFILES[name], deploy),
        tuple(check_target(scheme, name, path="engine")),
        tuple(check_target(scheme, name, path="pytorch")),
    )
