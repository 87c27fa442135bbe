"""One model through the compile stages: source → quantise → report and export → package.

`kiln compile` runs this for the recipe's model and, with `speculative:`, for its draft:
one function, so both get the same behaviour (pre-quantised sources converted as they are,
stage timings, hard-linked outputs, a cached source whose files were deleted rebuilt). A
stage writes only into its own cache directory (compiler/stages.py); the package step
publishes an artifact (runtime/formats/artifact) and returns where it landed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.float_reference import (
    ReferenceProcess,
    ReferenceRun,
    start_process,
    start_reference,
)
from kiln.compiler.stages import StageCache, StageResult, input_key
from kiln.compiler.trtllm.deploy import checkpoint_dir, export_for
from kiln.quant import calibration
from kiln.quant.prequantized import convert as prequantized
from kiln.quant.prequantized.detect import PreQuantized
from kiln.quant.report_html import REPORT_HTML
from kiln.quant.report_html import render as render_report
from kiln.quant.spec import CalibrationSpec, Scheme
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.heap import collection_paused
from kiln.runtime.formats import artifact
from kiln.runtime.formats.artifact import (
    ExportRecord,
    Manifest,
    SchemeRecord,
    SourceRecord,
    StageRecord,
)
from kiln.runtime.formats.model_info import ModelInfo

# A step ("quantize: ..."), or a count of its work ending in "(done/total)" (compiler/cli/
# progress.py shows both).
Progress = Callable[[str], None]
REPORT_FILE = "quantization.json"


@dataclass(frozen=True)
class ModelJob:
    """One model to compile: the recipe's model (role "") or its speculative draft."""

    role: str  # "" for the model, "draft" for the draft; prefixes the stage names
    name: str  # the artifact's name
    source: sources.SourceRef
    info: ModelInfo
    scheme: Scheme  # resolved in preflight
    calibration: CalibrationSpec
    report: CalibrationSpec | None  # held-out text for the quality report; None: no report
    imported: PreQuantized | None  # a published AWQ/GPTQ checkpoint, converted as it is
    tps: tuple[int, ...]  # tensor-parallel sizes to export for TensorRT-LLM
    recipe: dict[str, Any]  # what the manifest records as the recipe

    def stage(self, name: str) -> str:
        return f"{self.role}-{name}" if self.role else name


@dataclass
class ModelBuild:
    """A model's finished stages: where its float source and quantised checkpoint are."""

    job: ModelJob
    source_digest: str
    source_model: Path  # the float checkpoint the quantiser read
    quantized: StageResult  # `model/` inside it is the quantised checkpoint
    quant_key: str  # the hash everything downstream of quantisation depends on
    report: StageResult | None = None
    exports: dict[int, StageResult] = field(default_factory=dict)
    stages: list[StageResult] = field(default_factory=list)

    @property
    def model(self) -> Path:
        return self.quantized.path / "model"

    @property
    def scheme(self) -> SchemeRecord:
        return SchemeRecord.from_dict(self.quantized.record, str(self.quantized.path))

    def export(self, tp: int) -> ExportRecord:
        return ExportRecord.from_dict(self.exports[tp].record, str(self.exports[tp].path))

    def source_record(self) -> SourceRecord:
        job = self.job
        return SourceRecord(job.source.spec, job.source.kind, self.source_digest,
                            job.info.architecture, job.info.num_parameters)  # fmt: skip

    def manifest(self, tools: dict[str, str], **sections: Any) -> Manifest:
        """The manifest of this model's artifact (`sections`: targets, speculative, ...)."""
        return Manifest(
            name=self.job.name,
            recipe=self.job.recipe,
            source=self.source_record(),
            scheme=self.scheme,
            tools=tools,
            stages={s.name: StageRecord(s.status, s.key, round(s.seconds, 3)) for s in self.stages},
            **sections,
        )


def calibration_inputs(spec: CalibrationSpec, needs_data: bool) -> dict[str, Any]:
    """What a calibration spec contributes to a cache key: its settings and data digest."""
    return {
        **dataclasses.asdict(spec),
        "base_dir": None,  # where the recipe sits is not an input; the data's digest is
        "digest": calibration.dataset_digest(spec) if needs_data else None,
    }


def _link_or_copy(a: str, b: str) -> None:
    try:
        os.link(a, b)
    except OSError:
        shutil.copy2(a, b)


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link a finished stage's files into an artifact (copy across filesystems)."""

    shutil.copytree(src, dst, copy_function=_link_or_copy)


REMOTE_CODE_KEY = "auto_map"  # config.json / tokenizer_config.json: classes to import from *.py


def link_model(src: Path, dst: Path) -> None:
    """`link_tree` for a checkpoint that will be published: without remote code.

    A source model's `*.py` files and its configs' `auto_map` would let any loader run with
    `trust_remote_code=True` execute code kiln never gated (kiln itself never sets it), so
    neither is published: the files are left out, and a JSON file naming remote classes is
    written anew without them (never edited through its hard link into the stage cache).
    """
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py"), copy_function=_link_or_copy)
    for path in dst.rglob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # not a config; published as it is
        if isinstance(data, dict) and REMOTE_CODE_KEY in data:
            del data[REMOTE_CODE_KEY]
            path.unlink()
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_model(
    job: ModelJob,
    cache: StageCache,
    tools: dict[str, str],
    *,
    force: bool = False,
    progress: Progress = lambda _msg: None,
    after_exports: Callable[[ModelBuild, Progress], None] | None = None,
    final: Callable[[ModelBuild, Path], None] | None = None,
) -> ModelBuild:
    """Run (or find cached) every stage of `job` up to its TensorRT-LLM exports;
    `after_exports(build, progress)` runs after them, beside the report as they do, and
    `final(build, folder)` hears each folder an artifact links as soon as it will not change
    (the quantised model as the exports start, each export as it ends)."""
    who = f"{job.role}: " if job.role else ""
    needs_data = job.imported is None and job.scheme.needs_calibration
    # While the source is hashed, the texts' thread imports transformers and loads a tokenizer.
    with collection_paused():
        texts_ahead = _texts_ahead(job, needs_data)
        early = _reference_early(job, texts_ahead is not None)
        try:
            progress(f"{who}source: hashing and materialising {job.source.spec}")
            digest = sources.source_digest(job.source)
        except BaseException:
            if early is not None:
                early.stop()
            raise
    source_key = input_key("source", digest)

    def run_source(out: Path) -> dict[str, Any]:
        model = sources.float_checkpoint(job.source, out / "model")
        # Relative when converted into the stage's own directory (which is renamed after
        # this returns); absolute when the source is used in place.
        return {"model_dir": str(model.relative_to(out) if model.is_relative_to(out) else model)}

    try:
        src = cache.run(job.stage("source"), source_key, run_source, force)
        if not (src.path / src.record["model_dir"]).is_dir():  # deleted by hand: redo it
            src = cache.run(job.stage("source"), source_key, run_source, True)
    except BaseException:
        if early is not None:
            early.stop()
        raise
    model_dir = src.path / src.record["model_dir"]
    stages = [src]

    calib_inputs = calibration_inputs(job.calibration, needs_data)
    spec = dataclasses.asdict(job.scheme.spec)
    quant_key = input_key("quantize", digest, spec, calib_inputs, tools)

    def run_quantize(out: Path) -> dict[str, Any]:
        from kiln.quant.logs import route_library_logs_to_stderr
        from kiln.quant.quantize import quantize

        route_library_logs_to_stderr()
        (out / "model").mkdir()
        if job.imported is not None:
            return prequantized.convert(model_dir, out / "model").to_dict()
        scheme = quantize(model_dir, job.scheme, job.calibration, out / "model",
                          progress=progress, routing_out=out / ROUTING_FILE)  # fmt: skip
        check_coverage(job, out)
        return scheme.to_dict()

    texts: list[list[str]] = []

    def report_texts() -> list[str]:  # read once, for the float half and the report
        if not texts:
            ahead = texts_ahead.result() if texts_ahead is not None else None
            texts.append(ahead if ahead is not None else _report_texts(job, model_dir, needs_data))
        return texts[0]

    reference = None
    if force or cache.lookup(job.stage("quantize"), quant_key) is None:  # it will calibrate
        reference = _reference_beside(job, model_dir, quant_key, calib_inputs, report_texts,
                                      cache, force, early)  # fmt: skip
    elif early is not None:
        early.stop()
    progress(f"{who}quantize: {job.scheme.name} with {job.scheme.spec.backend}")
    try:
        quantized = cache.run(job.stage("quantize"), quant_key, run_quantize, force)
    except BaseException:
        if reference is not None:
            reference.stop()
        raise
    stages.append(quantized)
    build = ModelBuild(job, digest, model_dir, quantized, quant_key, stages=stages)

    said = _serialised(progress)

    def exports() -> None:
        if final is not None:
            final(build, build.model)
        for tp in job.tps:
            said(f"{who}export: TensorRT-LLM checkpoint, tp={tp}")

            def run_export(out: Path, tp: int = tp) -> dict[str, Any]:
                algo = build.scheme.trtllm_quant_algo
                return export_for(build.model, tp, algo, out / "checkpoint").to_dict()

            export_key = input_key("export", quant_key, tp)
            stage = job.stage(f"export-tp{tp}")
            build.exports[tp] = cache.run(stage, export_key, run_export, force)
            if final is not None:
                final(build, build.exports[tp].path)
        if after_exports is not None:
            after_exports(build, said)

    if job.report is not None:
        report = job.report
        try:
            with running_beside(exports if job.tps or after_exports else None, said, who):
                ready = reference.result(said) if reference is not None else None
                if ready is not None:
                    said(f"{who}report: the float model's log-probabilities were computed "
                         "beside the quantisation; running the quantised model")  # fmt: skip
                build.report = _report(build, report, calib_inputs, report_texts, cache, force,
                                       _named(said, f"{who}report"), ready)  # fmt: skip
        finally:
            if reference is not None:
                reference.stop()
        stages.append(build.report)
    else:
        exports()
    stages.extend(build.exports[tp] for tp in job.tps)
    return build


def _named(progress: Progress, stage: str) -> Progress:
    """`progress` for a stage run beside another: its messages that do not start with its
    name ("quantised model batches run (3/8)") get it, so a log does not charge them to the
    export whose step was announced last."""
    name = stage.removeprefix("draft: ")

    def say(message: str) -> None:
        progress(message if message.startswith(f"{name}: ") else f"{stage}: {message}")

    return say


def _serialised(progress: Progress) -> Progress:
    """`progress` for stages running at once: one message at a time."""
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            progress(message)

    return say


@contextmanager
def running_beside(work: Callable[[], None] | None, progress: Progress, who: str) -> Iterator[None]:
    """Run `work` (the TensorRT-LLM exports, then the PyTorch path's conversion) in a thread
    while the block runs (the report): both read only the quantised stage and write only their
    own directories, and the report's forwards (on the GPU where there is one) leave the
    export's reading, converting and writing the cores it needs. The block's error is raised
    after `work` has ended (a second Ctrl-C leaves at once); otherwise `work`'s error is
    raised."""
    if work is None:
        yield
        return
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the caller, raised there
            failure.append(exc)

    thread = threading.Thread(target=run, name="kiln-export", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        if thread.is_alive():
            progress(f"{who}export: finishing the checkpoint being written before stopping")
        thread.join()
        raise
    thread.join()
    if failure:
        raise failure[0]


COVERAGE_FILE = "coverage.json"
ROUTING_FILE = "moe_routing.json"


def check_coverage(job: ModelJob, out: Path) -> None:
    """Count the quantised checkpoint's linears by kind into the stage (the report shows
    them); UsageError naming the modules when the scheme quantised none, or left float one
    that nothing keeps float."""
    from kiln.quant.coverage import coverage, coverage_problem

    if job.scheme.spec.method == "none":
        return
    found = coverage(out / "model", job.info, job.scheme.spec.ignore)
    (out / COVERAGE_FILE).write_text(artifact.json_dumps(found))
    if (problem := coverage_problem(found, job.scheme.name)) is not None:
        raise UsageError(f"{job.source.spec}: {problem}")


# Below this size the report's float half costs less than the ~3 s of CPU a process of its own
# takes to start (importing torch and transformers): it is computed in the report, as before.
REFERENCE_BESIDE_MIN_PARAMETERS = 500_000_000


def _report_key(quant_key: str, calib_inputs: dict[str, Any], spec: CalibrationSpec) -> str:
    return input_key("report", quant_key, calib_inputs, calibration_inputs(spec, True))


def _report_texts(job: ModelJob, model_dir: Path, needs_data: bool) -> list[str]:
    """The held-out texts the report runs on: never one the model was calibrated on."""
    from transformers import AutoTokenizer

    assert job.report is not None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    seen = calibration.load_texts(job.calibration, tokenizer) if needs_data else []
    return calibration.load_texts(job.report, tokenizer, exclude=seen)


def _texts_ahead(job: ModelJob, needs_data: bool) -> Future[list[str] | None] | None:
    """The report's held-out texts read on a thread of their own while the source is hashed
    (tokenizer, data and transformers' import, ~3 s of one core, beside a hash of one core per
    file), where the hash will read files, so the compile calibrates, hence reports, after
    it; None where kiln knows the source's digest already or reads its texts elsewhere. The
    future answers None where reading failed: the caller reads again and meets the error."""
    if job.report is None or job.imported is not None or not sources.used_in_place(job.source):
        return None
    if sources.digest_known(job.source):
        return None
    model_dir = job.source.path

    def read() -> list[str] | None:
        try:
            return _report_texts(job, model_dir, needs_data)
        except Exception:  # raised again, where it was before, by the caller's own read
            return None

    pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-texts")
    try:
        return pool.submit(read)
    finally:
        pool.shutdown(wait=False)


def _reference_beside(
    job: ModelJob,
    model_dir: Path,
    quant_key: str,
    calib_inputs: dict[str, Any],
    report_texts: Callable[[], list[str]],
    cache: StageCache,
    force: bool,
    early: ReferenceProcess | None = None,
) -> ReferenceRun | None:
    """The report's float log-probabilities started beside the quantisation (compiler/
    float_reference.py), where the report will run and has a float model to compare with:
    handed to `early` (the process started while the source was hashed) where there is one,
    which is stopped where they are not needed."""
    report = job.report
    try:
        key = _report_key(quant_key, calib_inputs, report) if report is not None else ""
        if (
            report is None
            or not _reference_wanted(job)
            or (not force and cache.lookup(job.stage("report"), key) is not None)
        ):
            if early is not None:
                early.stop()
            return None
        from kiln.quant.layer_report import report_samples

        samples = report_samples(model_dir, report_texts(), report.max_seq_len)
        parent = cache.stage_dir(job.stage("report"), key).parent
    except BaseException:
        if early is not None:
            early.stop()
        raise
    prefix = f".{key[:12]}-reference-"
    if early is None:
        return start_reference(model_dir, samples, parent, prefix)
    return early.start(model_dir, samples, parent, prefix)


def _reference_wanted(job: ModelJob) -> bool:
    """Whether the report's float half runs beside the quantiser, if the report runs."""
    if job.report is None or job.imported is not None:
        return False
    return job.info.num_parameters >= REFERENCE_BESIDE_MIN_PARAMETERS  # else the report's


def _reference_early(job: ModelJob, new_source: bool) -> ReferenceProcess | None:
    """The float half's process, started while a new source is hashed (where the compile
    will calibrate, unless a stage cache holds the same source under another path), so its
    imports use the core the hash leaves idle; None where it would not run or the source's
    digest is known (the quantiser starts at once: the process is started then)."""
    if not new_source or not _reference_wanted(job):
        return None
    return start_process()


def _report(
    build: ModelBuild,
    spec: CalibrationSpec,
    calib_inputs: dict[str, Any],
    report_texts: Callable[[], list[str]],
    cache: StageCache,
    force: bool,
    progress: Progress,
    reference: Path | None = None,
) -> StageResult:
    """The quality report of the quantised model against its float source on held-out text
    (`reference`: the float log-probabilities, computed beside the quantisation)."""
    job = build.job
    key = _report_key(build.quant_key, calib_inputs, spec)

    def run_report(out: Path) -> dict[str, Any]:
        from kiln.quant.layer_report import SMOOTHING_METHODS, quantization_report

        if job.imported is not None:
            reason = "imported pre-quantised checkpoint: there is no float model to compare with"
            (out / REPORT_FILE).write_text(artifact.json_dumps({"skipped": reason}))
            return {"summary": {"skipped": reason}}
        texts = report_texts()
        smoothing = job.scheme.spec.method in SMOOTHING_METHODS
        report = quantization_report(build.source_model, build.model, texts,
                                     max_seq_len=spec.max_seq_len, smoothing=smoothing,
                                     scratch=out, progress=progress,
                                     reference=reference)  # fmt: skip
        for key, name in (("coverage", COVERAGE_FILE), ("moe_routing", ROUTING_FILE)):
            if (build.quantized.path / name).is_file():
                report[key] = json.loads((build.quantized.path / name).read_text())
        (out / REPORT_FILE).write_text(artifact.json_dumps(report))
        return {"summary": {k: v for k, v in report.items() if not isinstance(v, (dict, list))}}

    progress("report: per-layer error and KL divergence on held-out text")
    return cache.run(job.stage("report"), key, run_report, force)


def fill_artifact(build: ModelBuild, staging: Path) -> None:
    """Put a model's quantised checkpoint, report and TensorRT-LLM checkpoints in place."""
    link_model(build.model, staging / artifact.MODEL_DIR)
    if build.report is not None:
        reports = staging / artifact.REPORTS_DIR
        reports.mkdir()
        shutil.copy2(build.report.path / REPORT_FILE, reports / REPORT_FILE)
        report = json.loads((reports / REPORT_FILE).read_text())
        (reports / REPORT_HTML).write_text(render_report(report, build.job.name))
    for tp, exported in build.exports.items():
        if (exported.path / "checkpoint").is_dir():
            link_tree(exported.path / "checkpoint", staging / checkpoint_dir(tp))
