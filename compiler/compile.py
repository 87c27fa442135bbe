"""`kiln compile`: recipe → preflight → the model's stages (and its draft's) → artifact.

Each stage is keyed by a hash of its inputs (compiler/stages.py); one pipeline
(compiler/pipeline.py) runs the model and its speculative draft alike; the artifact is
assembled in a hidden directory and renamed into place (runtime/formats/artifact).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler.draft.speculation import Speculation, compile_draft
from kiln.compiler.leftovers import sweep_output, sweep_user_cache
from kiln.compiler.pipeline import (
    ModelBuild,
    ModelJob,
    Progress,
    build_model,
    fill_artifact,
    link_tree,
)
from kiln.compiler.preflight import CompilePlan, compile_jobs, run_preflight
from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.stages import (
    CACHE_DIR,
    PARTIAL,
    StageCache,
    StageResult,
    input_key,
    output_lock,
)
from kiln.compiler.trtllm.deploy import (
    PYTORCH_HF_DIR,
    Conversion,
    TargetContext,
    TargetFailure,
    convert_ahead,
    needs_conversion,
    pytorch_checkpoint,
    target_failures,
    write_target,
)
from kiln.runtime.base.cache import cache_home
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.base.versions import COMPILE_TOOLS, versions
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact import KnownDigests, Manifest
from kiln.runtime.formats.artifact.verified import verify_artifact

log = logging.getLogger(__name__)


@dataclass
class CompileResult:
    """What `kiln compile` did: the artifact, each stage's status, and the float source."""

    artifact: Path
    digest: str
    up_to_date: bool
    stages: list[StageResult] = field(default_factory=list)
    manifest: Manifest | None = None
    source_model: Path | None = None  # the float checkpoint the model was quantised from

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact),
            "digest": self.digest,
            "up_to_date": self.up_to_date,
            "stages": {
                s.name: {"status": s.status, "seconds": round(s.seconds, 3)} for s in self.stages
            },
            "targets": target_statuses(self.manifest) if self.manifest else {},
        }


def target_statuses(manifest: Manifest) -> dict[str, dict[str, str]]:
    """Per GPU target, the status of each TensorRT-LLM path (built, planned, ready, ...)."""
    return {
        name: {"engine": t.engine, "pytorch": t.pytorch} for name, t in manifest.targets.items()
    }


def _quiet(_: str) -> None:
    pass


def compile_recipe(
    recipe_path: str | Path,
    *,
    output: Path | None = None,
    force: bool = False,
    progress: Progress = _quiet,
) -> CompileResult:
    """Run every stage of a recipe and return the published artifact."""
    recipe = load_recipe(recipe_path)
    root = (output or recipe.output_dir()).resolve()
    pre = run_preflight(recipe, output=root, force=force)
    with output_lock(root):
        cache = StageCache(root / CACHE_DIR)
        sweep_output(root)  # what a killed run left, here and in the per-user cache
        sweep_user_cache(cache_home())
        return _run_stages(pre, cache, root, force, progress)


def model_job(pre: CompilePlan) -> ModelJob:
    """The recipe's model as a job for the pipeline."""
    return compile_jobs(pre)[0]


def _run_stages(
    pre: CompilePlan, cache: StageCache, root: Path, force: bool, progress: Progress
) -> CompileResult:
    tools = versions(COMPILE_TOOLS)
    ahead = PackageAhead(root, pre.trtllm_path if pre.targets else "engine")
    try:
        return _stages_and_package(pre, cache, root, force, progress, tools, ahead)
    finally:
        ahead.remove()


@dataclass
class PackageAhead:
    """What the package needs, made in the export thread beside the report (compiler/
    pipeline.py `after_exports`) where that thread would otherwise wait for the report: the
    PyTorch path's ModelOpt HF conversion of the model, written into a hidden `.partial` folder
    of the output directory (swept if a run is killed; the package hard-links it into the
    artifact, and the folder is removed when the compile ends), and the digests of the stage
    files the artifact will link (runtime/formats/artifact KnownDigests), each folder hashed
    on a thread of its own as soon as it is final (pipeline.py `final`), while its files are
    more likely still in the page cache than after the conversion (the 8B shape on a 24 GiB
    host: 33.4 → 29.9 GB read from disk while the report and exports ran, report 62.7 → 59.3 s,
    one run each; no change at 1.17B, where everything stays cached)."""

    root: Path
    path: str  # deploy.trtllm_path; "engine" where no target is compiled
    conversion: Conversion | None = None
    dir: Path | None = None
    known: KnownDigests = field(default_factory=KnownDigests)
    hashing: list[threading.Thread] = field(default_factory=list)

    def final(self, build: ModelBuild, folder: Path) -> None:
        if build.quantized.status == "cached":  # as `write`
            return
        # a daemon: it only reads, and a compile stopped meanwhile need not wait for it
        thread = threading.Thread(
            target=self._hash, args=(folder,), name="kiln-hash-ahead", daemon=True
        )
        thread.start()
        self.hashing.append(thread)

    def _hash(self, folder: Path) -> None:
        files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
        # a file that cannot be read now is hashed when publishing, which says what is wrong
        with contextlib.suppress(ArtifactError, OSError):
            self.known.add(sorted(files))

    def write(self, build: ModelBuild, progress: Progress) -> None:
        try:
            if build.quantized.status == "cached":  # the package may be cached too
                return  # (where it runs, it hashes what it links itself)
            scheme = build.scheme
            fmt, algo = scheme.format, scheme.trtllm_quant_algo or "NO_QUANT"
            if needs_conversion(self.path, fmt, algo):
                progress("export: ModelOpt HF checkpoint for the PyTorch path")
                out = self.folder() / "hf"
                self.conversion = convert_ahead(build.model, fmt, algo, out)
                self._hash(out.parent)
        finally:
            for thread in self.hashing:
                thread.join()

    def folder(self) -> Path:
        """A new hidden folder to write the conversion in (removed by `remove`)."""
        self.dir = Path(tempfile.mkdtemp(prefix=".pytorch-hf-", suffix=PARTIAL, dir=self.root))
        return self.dir

    def remove(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _stages_and_package(
    pre: CompilePlan,
    cache: StageCache,
    root: Path,
    force: bool,
    progress: Progress,
    tools: dict[str, str],
    ahead: PackageAhead,
) -> CompileResult:
    recipe = pre.recipe
    model = build_model(model_job(pre), cache, tools, force=force, progress=progress,
                        after_exports=ahead.write, final=ahead.final)  # fmt: skip
    stages = list(model.stages)

    speculation: Speculation | None = None
    if pre.speculative is not None:  # the draft: a nested artifact, and K when auto
        speculation = compile_draft(pre.speculative, recipe, model, cache, tools, force=force,
                                    progress=progress)  # fmt: skip
        stages.extend(speculation.stages)

    package_key = input_key("package", [s.key for s in stages], pre.resolved, tools,
                            *([speculation.key] if speculation else []))  # fmt: skip
    previous = cache.lookup("package", package_key)
    if previous is not None and not force:
        path = Path(previous.record["artifact"])
        try:  # "up to date" means the published artifact still verifies
            manifest = verify_artifact(path, action="reuse it").manifest
        except ArtifactError as exc:
            # Its files are hard links into the stage cache, so the damage may be the
            # cache's too: every stage runs again.
            log.warning("%s", exc.message)
            progress(f"package: {path} no longer matches its manifest; compiling it again")
            return _run_stages(pre, cache, root, True, progress)
        return CompileResult(path, manifest.digest, True, [*stages, previous], manifest,
                             model.source_model)  # fmt: skip

    manifest = model.manifest(tools, speculative=speculation.section if speculation else None)
    context = TargetContext(
        info=pre.info,
        scheme=pre.scheme,
        deploy=pre.deploy,
        path=pre.trtllm_path,
        exports={tp: model.export(tp) for tp in model.exports},
        speculative=speculation.target if speculation else None,
        model_format=model.scheme.format,
        quant_algo=model.scheme.trtllm_quant_algo or "NO_QUANT",
    )

    def package(out: Path) -> dict[str, Any]:
        with artifact.assemble(root, manifest, known=ahead.known) as staging:
            fill_artifact(model, staging.dir)
            if speculation is not None:
                speculation.install(staging.dir)
            conversion = ahead.conversion
            if conversion is not None and conversion.dir is not None:
                link_tree(conversion.dir, staging.dir / PYTORCH_HF_DIR)
            served = context
            if pre.targets:
                served = pytorch_checkpoint(staging.dir, context, conversion)
            for name, target in pre.targets.items():
                progress(f"engines: {name}")
                manifest.targets[name] = write_target(staging.dir, target, served)
            failures = [f for n, t in manifest.targets.items() for f in target_failures(n, t)]
            if failures:  # raised inside assemble: the staging directory is discarded
                raise TargetFailure(failures, target_statuses(manifest))
        return {"artifact": str(staging.path), "digest": manifest.digest}

    progress("package: hashing and publishing the artifact")
    packaged = cache.run("package", package_key, package, True)
    stages.append(packaged)
    return CompileResult(Path(packaged.record["artifact"]), manifest.digest, False, stages,
                         manifest, model.source_model)  # fmt: skip


__all__ = ["CompileResult", "ModelBuild", "compile_recipe", "model_job"]
