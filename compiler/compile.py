"""`kiln compile`: recipe → preflight → source → quantise → report → artifact.

Each stage is keyed by a hash of its inputs (compiler/stages.py); the artifact is assembled
in a hidden directory and renamed into place (runtime/artifact.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import quant
from kiln.compiler import sources
from kiln.compiler.preflight import Preflight, run_preflight
from kiln.compiler.recipe import load_recipe
from kiln.compiler.speculative import Speculation, compile_draft
from kiln.compiler.stages import StageCache, StageResult, input_key, output_lock
from kiln.compiler.trtllm.deploy import checkpoint_dir, export_for, write_target
from kiln.quant import calibration, prequantized
from kiln.quant.logs import route_library_logs_to_stderr
from kiln.quant.report import quantization_report
from kiln.runtime import artifact
from kiln.runtime.artifact import Manifest
from kiln.runtime.versions import COMPILE_TOOLS, versions

CACHE_DIR = ".kiln-cache"


@dataclass
class CompileResult:
    """What `kiln compile` did: the artifact and each stage's status."""

    artifact: Path
    digest: str
    up_to_date: bool
    stages: list[StageResult] = field(default_factory=list)
    manifest: Manifest | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact),
            "digest": self.digest,
            "up_to_date": self.up_to_date,
            "stages": {
                s.name: {"status": s.status, "seconds": round(s.seconds, 3)} for s in self.stages
            },
        }


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def _copy_tree(src: Path, dst: Path) -> None:
    """Hard-link a finished stage's files into the artifact (copy across filesystems)."""

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy)


def compile_recipe(
    recipe_path: str | Path,
    *,
    output: Path | None = None,
    force: bool = False,
    progress: Progress = _quiet,
) -> CompileResult:
    """Run every stage of a recipe and return the published artifact."""
    recipe = load_recipe(recipe_path)
    pre = run_preflight(recipe)
    root = (output or recipe.output_dir()).resolve()
    with output_lock(root):
        cache = StageCache(root / CACHE_DIR)
        cache.sweep_partials()
        return _run_stages(pre, cache, root, force, progress)


def _run_stages(
    pre: Preflight, cache: StageCache, root: Path, force: bool, progress: Progress
) -> CompileResult:
    recipe = pre.recipe
    tools = versions(COMPILE_TOOLS)
    stages: list[StageResult] = []

    progress("source: hashing and materialising the model")
    source_digest = sources.source_digest(pre.source)

    def materialize(out: Path) -> dict[str, Any]:
        model_dir = sources.materialize(pre.source, root / CACHE_DIR / "sources")
        return {"model_dir": str(model_dir)}

    src = cache.run("source", input_key("source", source_digest), materialize, force)
    stages.append(src)
    model_dir = Path(src.record["model_dir"])
    if not model_dir.is_dir():  # the cached source entry was deleted by hand: redo it
        src = cache.run("source", input_key("source", source_digest), materialize, True)
        stages[-1] = src
        model_dir = Path(src.record["model_dir"])

    calib = pre.calibration
    needs_data = pre.imported is None and quant.schemes.resolve(pre.spec).needs_calibration
    calib_inputs = {
        **dataclasses.asdict(calib),
        "base_dir": None,
        "digest": calibration.dataset_digest(calib) if needs_data else None,
    }
    quant_key = input_key(
        "quantize", source_digest, dataclasses.asdict(pre.spec), calib_inputs, tools
    )

    def run_quantize(out: Path) -> dict[str, Any]:
        route_library_logs_to_stderr()
        (out / "model").mkdir()
        if pre.imported is not None:
            return prequantized.convert(model_dir, out / "model")
        return quant.quantize(model_dir, pre.spec, calib, out / "model", progress=progress)

    progress(f"quantize: {quant.schemes.resolve(pre.spec).name} with {pre.spec.backend}")
    quantized = cache.run("quantize", quant_key, run_quantize, force)
    stages.append(quantized)

    report_spec = recipe.report_spec()
    report_key = input_key(
        "report",
        quant_key,
        calib_inputs,
        {
            **dataclasses.asdict(report_spec),
            "base_dir": None,
            "digest": calibration.dataset_digest(report_spec),
        },
    )

    def run_report(out: Path) -> dict[str, Any]:
        from transformers import AutoTokenizer

        if pre.imported is not None:
            reason = "imported pre-quantised checkpoint: there is no float model to compare with"
            (out / "quantization.json").write_text(artifact.json_dumps({"skipped": reason}))
            return {"summary": {"skipped": reason}}

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # Held-out means held out: never report on a text the model was calibrated on.
        seen = calibration.load_texts(calib, tokenizer) if needs_data else []
        texts = calibration.load_texts(report_spec, tokenizer, exclude=seen)
        report = quantization_report(
            model_dir, quantized.path / "model", texts, max_seq_len=report_spec.max_seq_len
        )
        (out / "quantization.json").write_text(artifact.json_dumps(report))
        return {"summary": {k: v for k, v in report.items() if not isinstance(v, (dict, list))}}

    progress("report: per-layer error and KL divergence on held-out text")
    report = cache.run("report", report_key, run_report, force)
    stages.append(report)

    exports: dict[int, StageResult] = {}
    for tp in sorted({p.tp_size for p in pre.plans.values()}):
        progress(f"export: TensorRT-LLM checkpoint, tp={tp}")

        def run_export(out: Path, tp: int = tp) -> dict[str, Any]:
            algo = quantized.record.get("trtllm_quant_algo")
            return export_for(quantized.path / "model", tp, algo, out / "checkpoint")

        exports[tp] = cache.run(f"export-tp{tp}", input_key("export", quant_key, tp), run_export,
                                force)  # fmt: skip
        stages.append(exports[tp])

    speculation: Speculation | None = None
    if pre.speculative is not None:  # the draft: a nested artifact, and K when auto
        speculation = compile_draft(pre.speculative, recipe, cache, root / CACHE_DIR / "sources",
                                    quantized.path / "model", quant_key, sorted(exports), tools,
                                    force, progress)  # fmt: skip
        stages.extend(speculation.stages)

    package_key = input_key("package", quant_key, report_key, recipe.resolved(), source_digest,
                            tools, *([speculation.key] if speculation else []))  # fmt: skip
    previous = cache.lookup("package", package_key)
    if previous is not None and not force:
        path = Path(previous.record["artifact"])
        if (path / artifact.MANIFEST).is_file():
            manifest = artifact.load_manifest(path)
            return CompileResult(path, manifest.digest, True, [*stages, previous], manifest)

    manifest = Manifest(
        name=recipe.name,
        recipe=recipe.resolved(),
        source={
            "spec": pre.source.spec,
            "kind": pre.source.kind,
            "digest": source_digest,
            "architecture": pre.info.architecture,
            "parameters": pre.info.num_parameters,
        },
        scheme={k: v for k, v in quantized.record.items() if k not in ("stage", "key")},
        tools=tools,
        extra={"speculative": speculation.section} if speculation else {},
        stages={
            s.name: {"status": s.status, "seconds": round(s.seconds, 3), "key": s.key}
            for s in stages
        },
    )

    def package(out: Path) -> dict[str, Any]:
        with artifact.assemble(root, manifest) as staging:
            _copy_tree(quantized.path / "model", staging.dir / artifact.MODEL_DIR)
            reports = staging.dir / artifact.REPORTS_DIR
            reports.mkdir()
            shutil.copy2(report.path / "quantization.json", reports / "quantization.json")
            for tp, exported in exports.items():
                if (exported.path / "checkpoint").is_dir():
                    _copy_tree(exported.path / "checkpoint", staging.dir / checkpoint_dir(tp))
            if speculation is not None:
                speculation.install(staging.dir)
            for name, target_plan in pre.plans.items():
                progress(f"engines: {name}")
                outcome = write_target(
                    staging.dir, name, pre.info, pre.spec, recipe.deploy_spec(), target_plan,
                    exports[target_plan.tp_size].record, recipe.config.deploy.trtllm_path,
                    speculation.target if speculation else None,
                )  # fmt: skip
                manifest.targets[name] = {
                    **outcome.to_dict(),
                    "export": {k: v for k, v in exports[target_plan.tp_size].record.items()
                               if k not in ("stage", "key")},
                }  # fmt: skip
        return {"artifact": str(staging.path), "digest": manifest.digest}

    progress("package: hashing and publishing the artifact")
    packaged = cache.run("package", package_key, package, True)
    stages.append(packaged)
    return CompileResult(
        Path(packaged.record["artifact"]), manifest.digest, False, stages, manifest
    )
