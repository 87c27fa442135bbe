"""The per-target part of `kiln compile`: TensorRT-LLM export, engine build, serve options.

For every target in the recipe the artifact gets, under `engines/<target>/`:
- `plan.json`: the planner's memory/capacity answer;
- `build.sh` and the exact `trtllm-build` command (status `planned`), or the engines
  themselves with their `kiln-engine.json` stamp (status `built`, only where TensorRT-LLM
  1.2.x and a GPU of the target's compute capability are present);
- `trtllm-serve.yaml`: options for the PyTorch backend serving `model/` directly, or, for
  an llm-compressor checkpoint that backend does not load, its exact ModelOpt HF conversion
  in `trtllm/hf/` (compiler/trtllm/export/modelopt_hf.py; checked per tp by hf_rules.py);
and under `trtllm/tp<N>/` the unified checkpoint `trtllm-build` reads. A scheme that one
path cannot carry is recorded as `unsupported: <reason>` for that path; nothing pretends.

With speculative decoding (compiler/draft/speculation.py) the serve YAML gets a
`speculative_config`: that is what speculates, TensorRT-LLM 1.2's LLM API running DraftTarget
and NGram on the PyTorch backend only. The engine is planned for plain decoding (build.sh says
so) unless the recipe sets `speculative.external_draft_engine: true`; then the target engine
is planned for externally drafted tokens, a draft model adds its own engine plan (from the
nested draft artifact's `draft/trtllm/tp<N>/`), and kiln warns that only a C++ Executor API
client that passes its own draft tokens speculates with it.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.compiler.trtllm.build.builder import run_build
from kiln.compiler.trtllm.build.plan import (
    ENGINE_SPECULATION,
    BuildPlanError,
    DraftBuild,
    build_plan,
)
from kiln.compiler.trtllm.capacity import DeploySpec, Plan
from kiln.compiler.trtllm.export.modelopt_hf import convert_to_modelopt_hf
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint
from kiln.compiler.trtllm.rules.pytorch import HF_ALGOS, check_hf_checkpoint, pytorch_problem
from kiln.compiler.trtllm.rules.serve_options import check_serve_options
from kiln.compiler.trtllm.serve_config import serve_options, write_serve_config
from kiln.compiler.trtllm.target_plan import TargetPlan
from kiln.quant.schemes import FLOAT_SCHEME
from kiln.quant.spec import Scheme
from kiln.runtime.base.errors import KilnError, StageFailure
from kiln.runtime.formats.artifact import (
    MODEL_DIR,
    ExportRecord,
    TargetRecord,
    TargetSpeculation,
    json_dumps,
    load_manifest,
)
from kiln.runtime.formats.model_info import ModelInfo

TRTLLM_DIR = "trtllm"
PYTORCH_HF_DIR = f"{TRTLLM_DIR}/hf"  # the ModelOpt HF conversion the PyTorch path serves
PYTORCH_DRAFT_DIR = f"{TRTLLM_DIR}/hf-draft"  # and the draft's, where it needs one
ENGINES_DIR = "engines"
CHECKPOINT_DTYPE = "bfloat16"
# tensorrt_llm/llmapi/llm_args.py `supports_backend`: DraftTarget and NGram decoding run on
# the PyTorch backend only, so an engine planned for external drafts is served plainly.
PLAIN_ENGINE = (
    "plain decoding: speculative decoding is served by trtllm-serve.yaml's speculative_config "
    "(TensorRT-LLM 1.2's LLM API runs DraftTarget and NGram on the PyTorch backend only); "
    "speculative.external_draft_engine: true plans this engine for a C++ Executor API client "
    "that passes its own draft tokens"
)
log = logging.getLogger(__name__)


# Why a target on the PyTorch path has no `trtllm/tp<N>/`: compile.py exports none there.
NOT_EXPORTED = (
    "not exported: deploy.trtllm_path is pytorch, and only the engine path (trtllm-build) "
    "reads the TensorRT-LLM checkpoint; trtllm-serve loads the Hugging Face one"
)


def exported_tps(path: str, tps: set[int]) -> tuple[int, ...]:
    """The tensor-parallel sizes that get a TensorRT-LLM checkpoint (`trtllm/tp<N>/`): every
    target's where the recipe's `deploy.trtllm_path` takes the engine path, none for pytorch."""
    return () if path == "pytorch" else tuple(sorted(tps))


def checkpoint_dir(tp: int) -> str:
    """Artifact-relative directory of the TensorRT-LLM checkpoint for tensor parallel `tp`."""
    return f"{TRTLLM_DIR}/tp{tp}"


@dataclass
class SpeculativeTarget:
    """Speculative decoding as the engine plans and serve options need it."""

    method: str  # draft | ngram
    max_draft_len: int
    draft_dir: str | None = None  # artifact-relative nested draft artifact (method draft)
    scheme: Scheme = FLOAT_SCHEME  # the draft's
    info: ModelInfo | None = None  # the draft's shapes
    exports: dict[int, ExportRecord] = field(default_factory=dict)  # the draft's, per tp
    ngram_size: int = 3  # method ngram: max_matching_ngram_size
    external_draft_engine: bool = False  # also plan the engine for external draft tokens
    served_dir: str | None = None  # the draft trtllm-serve loads; None: `<draft_dir>/model`
    served_problem: str | None = None  # why no draft checkpoint that backend loads exists


@dataclass(frozen=True)
class TargetContext:
    """What every target of one artifact shares: the model, its scheme, how it is deployed."""

    info: ModelInfo
    scheme: Scheme
    deploy: DeploySpec
    path: str = "both"  # the recipe's deploy.trtllm_path: both | engine | pytorch
    exports: dict[int, ExportRecord] = field(default_factory=dict)  # `trtllm/tp<N>/`, per tp
    speculative: SpeculativeTarget | None = None
    model_format: str = "compressed-tensors"  # of what the PyTorch path serves
    quant_algo: str = "NO_QUANT"  # the TensorRT-LLM name of what it serves
    served_dir: str = MODEL_DIR  # artifact-relative checkpoint the PyTorch path serves
    served_problem: str | None = None  # why no checkpoint that path loads could be written


@dataclass
class Conversion:
    """The PyTorch path's conversion of the model's `model/`, written before the package (beside
    the report): its quant_algo and folder, or why none could be written."""

    algo: str | None
    dir: Path | None
    problem: str | None


def needs_conversion(path: str, fmt: str, algo: str) -> bool:
    """Whether the PyTorch path (`path`: the recipe's deploy.trtllm_path) serves a `fmt`
    checkpoint of `algo` from a ModelOpt HF conversion (or says why there is none)."""
    return path != "engine" and _converts(fmt, algo)


def _converts(fmt: str, algo: str) -> bool:
    return pytorch_problem(fmt, algo) is not None and fmt == "compressed-tensors"


def convert_ahead(model_dir: Path, fmt: str, algo: str, out: Path) -> Conversion:
    """The conversion of the quantised `model_dir` (a stage's `model/`) written to `out`, which
    the package then links into the artifact's `trtllm/hf/`; its problem names `model/` as the
    artifact does."""
    served, why = _convert(fmt, algo, model_dir, out, model_dir.parent)
    return Conversion(served, out if served else None, why)


def pytorch_checkpoint(
    root: Path, ctx: TargetContext, ahead: Conversion | None = None
) -> TargetContext:
    """`ctx` serving, on the PyTorch path, a checkpoint its backend loads: `model/` as it is
    where it loads that, else the exact ModelOpt HF conversion in `trtllm/hf/` of the artifact
    `root` (or, in `served_problem`, why none could be written): `ahead`'s, written before the
    package and linked there already, else written now."""
    if ctx.path == "engine":
        return ctx
    draft = ctx.speculative
    if draft is not None and draft.method == "draft" and draft.draft_dir is not None:
        # The draft's format and algorithm as its nested manifest records them (it has no
        # TensorRT-LLM export on the PyTorch path).
        scheme = load_manifest(root / draft.draft_dir).scheme
        fmt = scheme.format if scheme else "float"
        algo = (scheme.trtllm_quant_algo if scheme else None) or "NO_QUANT"
        src = root / draft.draft_dir / MODEL_DIR
        served, why = _convert(fmt, algo, src, root / PYTORCH_DRAFT_DIR, root)
        if served is None and why is None:  # served as it is, where that backend loads it
            why = pytorch_problem(fmt, algo)
        dir_ = PYTORCH_DRAFT_DIR if served else None
        ctx = replace(ctx, speculative=replace(draft, served_dir=dir_, served_problem=why))
    if ahead is not None:  # its folder is in place already (compiler/compile.py links it)
        served, why = ahead.algo, ahead.problem
    else:
        served, why = _convert(ctx.model_format, ctx.quant_algo, root / MODEL_DIR,
                               root / PYTORCH_HF_DIR, root)  # fmt: skip
    if served is None:
        return replace(ctx, served_problem=why)
    return replace(ctx, model_format="modelopt", quant_algo=served, served_dir=PYTORCH_HF_DIR)


def _convert(
    fmt: str, algo: str, src: Path, out: Path, root: Path
) -> tuple[str | None, str | None]:
    """(the quant_algo of `src`'s ModelOpt HF conversion written to `out`, None) where the
    PyTorch backend cannot load `src` itself but its conversion is exact; (None, why not)
    where neither, naming paths inside the artifact `root` relative to it (`root` is the
    staging directory, gone once the artifact is published); (None, None) where `src` loads
    as it is."""
    if not _converts(fmt, algo):
        return None, None
    try:
        return convert_to_modelopt_hf(src, out)["quant_algo"], None
    except KilnError as exc:
        shutil.rmtree(out, ignore_errors=True)
        return None, exc.message.replace(f"{root}/", "")


class TargetFailure(StageFailure):
    """Targets the recipe asks for that kiln could not plan, build or serve: nothing is
    published. `targets` holds every target's status (for `kiln compile --json`)."""

    def __init__(self, failures: list[str], targets: dict[str, dict[str, str]]) -> None:
        self.targets = targets
        lines = "\n".join(f"  {f}" for f in failures)
        super().__init__(
            f"TensorRT-LLM targets failed; the artifact was not published:\n{lines}\n"
            "fix: change the recipe's targets, quantization or deploy.trtllm_path, or build "
            "on a machine where trtllm-build succeeds"
        )


def target_failures(name: str, record: TargetRecord) -> list[str]:
    """Why target `name` fails the compile: a build that ran and failed, or no path the
    recipe asked for that is ready, planned or built."""
    paths = {"engine": record.engine, "pytorch": record.pytorch}
    if record.engine.startswith("failed"):
        return [f"{name}: engine {record.engine}"]
    asked = {p: s for p, s in paths.items() if not s.startswith("skipped")}
    if asked and all(s.startswith("unsupported") for s in asked.values()):
        return [f"{name}: {p} {s}" for p, s in asked.items()]
    return []


def export_for(quantized_model: Path, tp: int, quant_algo: str | None, out: Path) -> ExportRecord:
    """Export the quantised checkpoint for `tp`, or record why this mode has no export."""
    try:
        written = export_checkpoint(
            quantized_model, out, tp_size=tp, dtype=CHECKPOINT_DTYPE, quant_algo=quant_algo
        )
    except KilnError as exc:
        shutil.rmtree(out, ignore_errors=True)
        return ExportRecord(tp_size=tp, unsupported=exc.message)
    problems = check_checkpoint(out)  # what trtllm-build 1.2 would refuse to load
    if problems:
        shutil.rmtree(out, ignore_errors=True)
        return ExportRecord(tp_size=tp, unsupported="conformance: " + "; ".join(problems[:3]))
    return ExportRecord.from_dict(written, str(out))


def _unsupported(problems: list[Any]) -> str:
    return "unsupported: " + "; ".join(f"{p.problem} (use {p.allowed})" for p in problems)


def write_target(root: Path, target: TargetPlan, ctx: TargetContext) -> TargetRecord:
    """Fill `root/engines/<name>/` (root is the artifact being assembled) and say what it holds."""
    name, plan = target.name, target.capacity
    engine_dir = root / ENGINES_DIR / name
    engine_dir.mkdir(parents=True)
    (engine_dir / "plan.json").write_text(json_dumps(plan.to_dict()))
    speculative = ctx.speculative
    export = ctx.exports.get(plan.tp_size) or ExportRecord(plan.tp_size, unsupported=NOT_EXPORTED)
    record = TargetRecord(engine="", pytorch="", plan=f"{ENGINES_DIR}/{name}/plan.json",
                          tp_size=plan.tp_size, export=export)  # fmt: skip
    if speculative is not None:
        record.speculative = TargetSpeculation(speculative.method, speculative.max_draft_len)

    engine_problems = list(target.engine_problems)
    if ctx.path == "pytorch":
        record.engine = "skipped: deploy.trtllm_path is pytorch"
    elif engine_problems:
        record.engine = _unsupported(engine_problems)
    elif export.unsupported is not None:
        record.engine = f"unsupported: {export.unsupported}"
    else:
        record.engine = _build(root, target, ctx, record)

    pytorch_problems = list(target.pytorch_problems)
    loads = ctx.served_problem or pytorch_problem(ctx.model_format, ctx.quant_algo)
    if loads is None and ctx.model_format == "modelopt" and ctx.quant_algo in HF_ALGOS:
        tp_rules = check_hf_checkpoint(root / ctx.served_dir, plan.tp_size)
        loads = "conformance: " + "; ".join(tp_rules[:3]) if tp_rules else None
    if loads is None and speculative is not None and speculative.served_problem is not None:
        loads = f"the draft: {speculative.served_problem}"
    elif loads is None and speculative is not None and speculative.served_dir is not None:
        why_not = check_hf_checkpoint(root / speculative.served_dir, plan.tp_size)
        loads = f"the draft: conformance: {'; '.join(why_not[:3])}" if why_not else None
    if ctx.path == "engine":
        record.pytorch = "skipped: deploy.trtllm_path is engine"
    elif loads is not None:
        record.pytorch = f"unsupported: {loads}"
    elif pytorch_problems:
        record.pytorch = _unsupported(pytorch_problems)
    else:
        options = serve_options(ctx.scheme, ctx.deploy, plan, **_serve_speculation(speculative))
        problems = check_serve_options(options)
        if problems:
            record.pytorch = "unsupported: conformance: " + "; ".join(problems)
            return record
        # Paths are artifact-relative (the served checkpoint, a draft): serve from its root.
        header = f"from the artifact directory: {_pytorch_command(ctx, name)}"
        write_serve_config(engine_dir / "trtllm-serve.yaml", options, header)
        record.serve_config = f"{ENGINES_DIR}/{name}/trtllm-serve.yaml"
        record.pytorch = "ready"
    return record


def _pytorch_command(ctx: TargetContext, name: str) -> str | None:
    """The PyTorch path's trtllm-serve command, run from the artifact directory (None where
    the recipe keeps to the engine path)."""
    if ctx.path == "engine":
        return None
    return (f"trtllm-serve {ctx.served_dir} --backend pytorch --config "
            f"{ENGINES_DIR}/{name}/trtllm-serve.yaml")  # fmt: skip


def _serve_speculation(speculative: SpeculativeTarget | None) -> dict[str, Any]:
    """serve_options arguments for `speculative` (the draft's HF checkpoint, or n-gram)."""
    if speculative is None:
        return {}
    if speculative.method == "ngram":
        return {"max_draft_len": speculative.max_draft_len, "ngram_size": speculative.ngram_size}
    # Artifact-relative: trtllm-serve runs from the artifact directory (see the YAML header).
    draft_dir = speculative.served_dir or f"{speculative.draft_dir}/{MODEL_DIR}"
    return {"draft_dir": draft_dir, "max_draft_len": speculative.max_draft_len}


def _draft_build(root: Path, name: str, plan: Plan, speculative: SpeculativeTarget) -> DraftBuild:
    """The draft engine of draft-target speculation, from the nested artifact's checkpoint."""
    return DraftBuild(
        speculative.max_draft_len,
        root / str(speculative.draft_dir) / checkpoint_dir(plan.tp_size),
        root / ENGINES_DIR / name / "draft-engine",
        tp_size=plan.tp_size,
        scheme=speculative.scheme,
        info=speculative.info,
    )


def _build(root: Path, target: TargetPlan, ctx: TargetContext, record: TargetRecord) -> str:
    """Plan the engine build, run it where this machine can, and record the outcome."""
    name, plan = target.name, target.capacity
    engine_dir = root / ENGINES_DIR / name / "engine"
    speculative = ctx.speculative
    if speculative is not None and not speculative.external_draft_engine:
        speculative = None  # the engine decodes plainly; trtllm-serve.yaml speculates
    draft: DraftBuild | None = None
    extra: dict[str, str | None] | None = None
    if speculative is not None and speculative.method == "draft":
        draft_export = speculative.exports.get(plan.tp_size)
        if draft_export is None or draft_export.unsupported is not None:
            reason = draft_export.unsupported if draft_export else f"no tp={plan.tp_size} export"
            return f"unsupported: the draft: {reason}"
        draft = _draft_build(root, name, plan, speculative)
    elif speculative is not None:  # prompt lookup: the target alone takes external drafts
        extra = {"--speculative_decoding_mode": "draft_tokens_external",
                 "--max_draft_len": str(speculative.max_draft_len)}  # fmt: skip
    try:
        build = build_plan(ctx.info, ctx.scheme, target.profile, ctx.deploy, plan,
                           root / checkpoint_dir(plan.tp_size), engine_dir, draft=draft,
                           extra_args=extra)  # fmt: skip
    except BuildPlanError as exc:
        return "unsupported: " + "; ".join(str(p) for p in exc.problems)
    if speculative is not None:
        log.warning("%s: the engine is planned for external draft tokens: %s", name,
                    ENGINE_SPECULATION)  # fmt: skip
    elif ctx.speculative is not None:
        build.notes.append(PLAIN_ENGINE)
    # The recorded command and build.sh use artifact-relative paths: the artifact is renamed
    # into place after this, and is usually copied to a GPU builder before building.
    relative = build.relative_to(root)
    script = root / ENGINES_DIR / name / "build.sh"
    relative.write_script(script, cd="../..", pytorch_command=_pytorch_command(ctx, name))
    outcome = run_build(build, script_path=script, write_script=False)
    record.build = outcome.record(root, [p.command for p in relative.plans()])
    if outcome.status == "built":
        return "built"
    shutil.rmtree(engine_dir, ignore_errors=True)  # a failed build leaves no half engine
    if draft is not None:
        shutil.rmtree(draft.engine_dir, ignore_errors=True)
    return "planned" if outcome.status == "planned" else f"failed: {outcome.reason}"
