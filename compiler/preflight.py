"""Fail before spending: check a loaded recipe completely before any weights load, and
resolve it, once, into the frozen `CompilePlan` every later stage reads.

Every problem found is collected and reported at once: the model source and its
architecture, the scheme × backend × shapes, the calibration and report data, the target
GPUs and their support matrix, a speculative draft (the same checks, and a tokenizer equal
to the model's), whether calibration fits in this machine's memory, whether the model's weights
and tokenizer are there, and whether what the compile writes fits the free space of its
output's disk (compiler/disk/). Planning reads config.json alone: it checks neither the host
nor the weights and tokenizer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.disk import SKIP_VARIABLE, DiskEstimate, estimate_disk
from kiln.compiler.draft.check import SpeculativePlan, check_speculative
from kiln.compiler.draft.speculation import draft_job
from kiln.compiler.pipeline import ModelJob
from kiln.compiler.preflight_checks import (
    gate_problems,
    ignore_problems,
    length_problems,
    missing_files,
    model_problems,
)
from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import Recipe, load_recipe
from kiln.compiler.resolve import ResolvedScheme, resolve_scheme
from kiln.compiler.stages import output_problem
from kiln.compiler.trtllm.capacity import DeploySpec, Plan
from kiln.compiler.trtllm.deploy import exported_tps
from kiln.compiler.trtllm.target_plan import TargetPlan, plan_target, target_support
from kiln.compiler.trtllm.targets import PROFILES
from kiln.quant import calibration
from kiln.quant.memory import estimate_calibration_bytes
from kiln.quant.prequantized.detect import PreQuantized
from kiln.quant.quantize import moe_calibration_problem
from kiln.quant.spec import CalibrationSpec, Scheme
from kiln.runtime.base.errors import SourceError, UsageError
from kiln.runtime.formats.model_info import ModelInfo

GIB = 1 << 30


@dataclass(frozen=True)
class CompilePlan:
    """A recipe that passed every check, resolved: nothing downstream reads the recipe's
    quantization spec or the support matrix again."""

    recipe: Recipe
    resolved: dict[str, Any]  # the fully defaulted recipe (what the manifest records)
    source: sources.SourceRef
    info: ModelInfo
    scheme: Scheme  # the model's, resolved once (or the imported checkpoint's own)
    calibration: CalibrationSpec
    report: CalibrationSpec  # held-out text for the quality report
    deploy: DeploySpec
    trtllm_path: str  # deploy.trtllm_path: both | engine | pytorch
    targets: dict[str, TargetPlan] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    imported: PreQuantized | None = None  # a pre-quantised AWQ/GPTQ source, converted as is
    speculative: SpeculativePlan | None = None  # the draft (or n-gram) to compile beside it
    disk: DiskEstimate | None = None  # what the compile writes, and the room there

    @property
    def plans(self) -> dict[str, Plan]:
        """Each target's capacity plan (`kiln plan`)."""
        return {name: target.capacity for name, target in self.targets.items()}


def host_memory_bytes() -> int:
    """Physical memory of this machine; the budget calibration must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


SourceFacts = tuple[sources.SourceRef | None, ModelInfo | None]


def _source(recipe: Recipe, problems: list[str]) -> SourceFacts:
    """The model source and what its config says, or the problems that stop reading it."""
    ref: sources.SourceRef | None = None
    try:
        ref = sources.parse_source(recipe.config.model.source, recipe.base_dir("model.source"))
        info = sources.inspect_source(ref)
    except SourceError as exc:
        # SourceError messages name the key themselves; the problem line already does.
        problems.append(recipe.problem("model.source", exc.message.removeprefix("model.source ")))
        return ref, None
    problems.extend(recipe.problem("model.source", p) for p in sources.weight_problems(ref))
    return ref, info


def _targets(
    recipe: Recipe, info: ModelInfo | None, quant: ResolvedScheme, problems: list[str]
) -> dict[str, TargetPlan]:
    """Each known target of the recipe checked for the resolved scheme on the recipe's
    TensorRT-LLM path and planned where it runs; their problems added to `problems`."""
    deploy, path = recipe.deploy_spec(), recipe.config.deploy.trtllm_path
    targets: dict[str, TargetPlan] = {}
    for index, name in enumerate(recipe.config.targets):
        key = f"targets.{index}"
        if name not in PROFILES:
            known = "known targets: " + ", ".join(sorted(PROFILES))
            problems.append(recipe.problem(key, f"unknown GPU target {name!r}", known))
            continue
        if quant.scheme is None:
            problems.append(recipe.problem(key, f"cannot check {name}: the quantization "
                                           "section does not resolve to a TensorRT-LLM scheme",
                                           "fix the quantization problems first"))  # fmt: skip
            continue
        support = target_support(quant.scheme, name, info)
        found = support[path]
        problems.extend(recipe.problem(key, p.problem, p.allowed) for p in found)
        if info is None or found or not quant.usable:
            continue
        try:
            target = plan_target(info, quant.scheme, name, deploy, support)
        except UsageError as exc:
            problems.append(recipe.problem("deploy", exc.message))
            continue
        targets[name] = target
        if not target.capacity.fits:
            problems.append(
                recipe.problem(
                    key,
                    f"the model does not fit {name} at tp={target.tp_size} "
                    f"for max_seq_len {deploy.max_seq_len}",
                    "; ".join(target.capacity.suggestions) or "choose a larger GPU",
                )
            )
    return targets


def run_preflight(
    recipe: Recipe,
    *,
    check_memory: bool = True,
    output: Path | None = None,
    force: bool = False,
    need_checkpoint: bool | None = None,
) -> CompilePlan:
    """Check everything that can be checked without loading weights; raise RecipeError.

    `check_memory=False` skips the checks of the calibration host, its memory, the output
    directory and its free disk (planning needs none); `output` is where the artifact goes when
    not the recipe's own `output`; `force`: every stage will run again, cached or not;
    `need_checkpoint`: whether the model's weights and tokenizer must be there (by default
    when `check_memory`: a plan reads config.json alone). The disk check is skipped where
    $KILN_NO_DISK_CHECK is set.
    """
    problems: list[str] = []
    if check_memory and (problem := output_problem(output or recipe.output_dir())) is not None:
        problems.append(recipe.problem("output", problem, "a writable directory"))
    calib, resolved = recipe.calibration_spec(), recipe.resolved()
    ref, info = _source(recipe, problems)
    need = check_memory if need_checkpoint is None else need_checkpoint
    # Reported after the memory check: a config-only directory still gets every other answer.
    absent = missing_files(recipe, ref) if need and ref is not None else []
    arch_problems = sources.check_architecture(info) if info is not None else []
    problems.extend(recipe.problem("model.source", p) for p in arch_problems)
    if ref is not None and info is not None and not arch_problems:
        problems += model_problems(recipe, ref, info) + length_problems(recipe, info)
    quant = resolve_scheme(
        recipe, recipe.quant_spec(), info, calib, detect=info is not None and not arch_problems
    )
    problems += quant.problems
    if info is not None and quant.imported is None and quant.usable:
        problems += ignore_problems(recipe, info, recipe.quant_spec(), "quantization")
    if info is not None and quant.imported is None and quant.scheme is not None:
        why = moe_calibration_problem(info, quant.scheme, calib)
        if why is not None:
            problems.append(recipe.problem("calibration.moe_experts", why))
    problems += gate_problems(recipe)
    for p in calibration.check(recipe.report_spec()):
        key = p.key.replace("calibration.", "report.", 1)
        problems.append(recipe.problem(key, p.problem, p.allowed))
    targets = _targets(recipe, info, quant, problems)

    # The draft is checked like the model, its tokenizer against the model's, before any
    # calibration starts.
    speculative, draft_problems = check_speculative(recipe, resolved, ref, info)
    problems.extend(draft_problems)

    memory: dict[str, int] = {}
    scheme = quant.scheme
    if info is not None and scheme is not None and not problems and check_memory:
        memory = {} if quant.imported else estimate_calibration_bytes(info, scheme, calib)
        problems += _memory_problems(recipe, memory) if memory else []
    problems += absent

    if problems:
        raise RecipeError(problems)
    assert ref is not None and info is not None and scheme is not None  # no problems: resolved
    plan = CompilePlan(
        recipe=recipe,
        resolved=resolved,
        source=ref,
        info=info,
        scheme=scheme,
        calibration=calib,
        report=recipe.report_spec(),
        deploy=recipe.deploy_spec(),
        trtllm_path=recipe.config.deploy.trtllm_path,
        targets=targets,
        memory=memory,
        imported=quant.imported,
        speculative=speculative,
    )
    if not check_memory:
        return plan
    disk = disk_estimate(plan, output or recipe.output_dir(), force=force)
    if not os.environ.get(SKIP_VARIABLE) and (short := disk.problems()):
        fix = (f"free space, or point --output (or the recipe's `output:`) at a larger disk; "
               f"the estimate is an upper bound: {SKIP_VARIABLE}=1 skips this check")  # fmt: skip
        raise RecipeError([recipe.problem("output", p, fix) for p in short])
    return replace(plan, disk=disk)


def compile_jobs(plan: CompilePlan) -> list[ModelJob]:
    """The models `kiln compile` runs through the pipeline: the recipe's, then its draft's."""
    tps = exported_tps(plan.trtllm_path, {t.tp_size for t in plan.targets.values()})
    model = ModelJob(role="", name=plan.recipe.name, source=plan.source, info=plan.info,
                     scheme=plan.scheme, calibration=plan.calibration, report=plan.report,
                     imported=plan.imported, tps=tps, recipe=plan.resolved)  # fmt: skip
    spec = plan.speculative
    draft = [draft_job(spec, plan.recipe, tps)] if spec and spec.method == "draft" else []
    return [model, *draft]


def disk_estimate(plan: CompilePlan, output: Path, *, force: bool = False) -> DiskEstimate:
    """The disk compiling `plan` into `output` needs, stage by stage (`kiln plan`); `force`:
    with every stage run again."""
    jobs = compile_jobs(plan)
    return estimate_disk(jobs, plan.targets, plan.trtllm_path, plan.resolved, output, force=force)


def _memory_problems(recipe: Recipe, memory: dict[str, int]) -> list[str]:
    """Whether calibration fits in this machine's memory."""
    available = int(host_memory_bytes() * 0.9)  # leave room for the OS and the tokenizer
    if memory["total"] <= available:
        return []
    return [
        recipe.problem(
            "calibration.num_samples",
            f"calibration needs about {memory['total'] / GIB:.1f} GiB but this machine has "
            f"{available / GIB:.1f} GiB to spare",
            "lower calibration.num_samples or calibration.max_seq_len, or run on a larger host",
        )
    ]


def validate_recipe(recipe_path: str | Path) -> CompilePlan:
    """Load and preflight a recipe without running anything (`kiln validate`)."""
    return run_preflight(load_recipe(recipe_path))


def validate_recipe_plans(recipe_path: str | Path) -> dict[str, Plan]:
    """Preflight a recipe and return its per-target plans (`kiln plan`)."""
    return run_preflight(load_recipe(recipe_path), check_memory=False).plans
