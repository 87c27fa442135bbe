"""The disk a compile writes, estimated from the model's shapes and the resolved scheme before
any weight loads, and the free space it is checked against (`kiln validate`, `plan`, `compile`).

Per stage, as compiler/pipeline.py runs them, into the stage cache (<output>/.kiln-cache):
- source: nothing where the checkpoint is used in place; a GGUF (or builtin) dequantised to
  float32, a pytorch_model.bin re-saved in its own dtype (compiler/sources/materialize.py);
- quantize: the quantised Hugging Face checkpoint, its float parts (embeddings, norms, ignored
  linears) in the dtype it is calibrated in; while calibrating, a backend that offloads
  (llm-compressor) also writes the tensors it updates into the stage's folder, bounded by the
  float size of the linears it quantises and the norms it smooths (a MoE's experts twice);
- report: the per-layer report; from the quantise stage's start until it ends, the float
  model's log-probabilities of every held-out token (float32 × vocabulary) beside the stage's
  folder (compiler/float_reference.py, quant/layer_report.py);
- export-tp<N>: the TensorRT-LLM checkpoint for tensor parallel N (compiler/trtllm/export):
  the linears split over the ranks in the exported layout, embeddings and norms on every rank,
  float parts in bfloat16; written while the report runs, so the report's log-probabilities
  count as its scratch too;
- a speculative draft's stages likewise;
- the artifact: the stage outputs hard-linked (no new bytes where the stage cache is on the
  output's filesystem, a full copy where not), and what only it holds: the PyTorch path's
  ModelOpt HF conversion (trtllm/hf/), engines where this machine builds them, the report and
  the manifest.
A stage whose key the stage cache holds writes nothing. What a stage writes only while it runs
is removed when it ends, so the need is the peak over the stages in order: everything kept so
far plus the running stage's scratch. Each figure is meant as an upper bound: scales and zero
points count 4 bytes each, tokenizer and small files a fixed allowance.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.disk.sizes import (
    SLACK,
    export_bytes,
    float_bytes,
    hf_checkpoint_bytes,
    offload_bytes,
    report_bytes,
)
from kiln.compiler.disk.stage_cache import existing, leftover_bytes, packaged, stage_keys
from kiln.compiler.pipeline import REFERENCE_BESIDE_MIN_PARAMETERS, ModelJob
from kiln.compiler.sources.materialize import used_in_place
from kiln.compiler.stages import CACHE_DIR, StageCache
from kiln.compiler.trtllm.build.plan import TRTLLM_LINE
from kiln.compiler.trtllm.rules.pytorch import pytorch_problem
from kiln.compiler.trtllm.target_plan import TargetPlan
from kiln.quant.backends import BACKENDS
from kiln.quant.memory import DTYPE_BYTES, calibration_dtype
from kiln.runtime.base.versions import version

MARGIN = 0.05  # asked on top of the estimate: file-system metadata, and the estimate's own error
SKIP_VARIABLE = "KILN_NO_DISK_CHECK"
TOKENIZER_BYTES_PER_TOKEN = 128  # a tokenizer.json written from a vocabulary (~45 B a token)
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer*", "vocab.*", "merges.txt",
               "special_tokens_map.json", "added_tokens.json", "chat_template.*",
               "*.model")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DiskPart:
    """What one stage (or part of the artifact) writes: `where` is "cache" (a stage), "link"
    (stage outputs the artifact hard-links) or "artifact" (files only the artifact holds)."""

    name: str
    bytes: int  # kept
    where: str
    note: str = ""
    cached: bool = False  # the stage cache holds it already: nothing is written
    scratch: int = 0  # written while the stage runs, removed when it ends

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DiskEstimate:
    """The bytes a compile writes into its stage cache and artifact, and the room there."""

    output: Path
    cache_dir: Path
    parts: tuple[DiskPart, ...]
    same_filesystem: bool  # stage cache and output on one filesystem: links cost nothing
    free_output: int
    free_cache: int
    reclaimable: int  # what killed runs left under the output, removed before the stages run

    @property
    def cache_bytes(self) -> int:
        """What the stages keep in the stage cache."""
        return self._sum("cache")

    @property
    def artifact_bytes(self) -> int:
        """What the artifact adds: its own files, and the stage outputs it copies where it
        cannot link them."""
        return self._sum("artifact") + (0 if self.same_filesystem else self._sum("link"))

    @property
    def total(self) -> int:
        """Everything the compile keeps."""
        return self.cache_bytes + self.artifact_bytes

    @property
    def peak(self) -> int:
        """The most the compile holds at once on the output's filesystem (with the stage cache's,
        where they are one)."""
        if self.same_filesystem:
            return self._peak(("cache", "artifact"))
        return self.artifact_bytes

    @property
    def cache_peak(self) -> int:
        """The most the stages hold at once in the stage cache."""
        return self._peak(("cache",))

    @property
    def cached(self) -> list[str]:
        """The stages the stage cache holds already."""
        return [p.name for p in self.parts if p.cached and p.where == "cache"]

    def _sum(self, where: str) -> int:
        return sum(p.bytes for p in self.parts if p.where == where and not p.cached)

    def _peak(self, where: tuple[str, ...]) -> int:
        kept = peak = 0
        for part in self.parts:
            if part.where in where and not part.cached:
                peak = max(peak, kept + part.bytes + part.scratch)
                kept += part.bytes
        return peak

    def problems(self) -> list[str]:
        """Each filesystem with less free than the compile needs there (with the margin), in
        words naming both numbers and both paths."""
        leftovers = (f" (counting {human(self.reclaimable)} that killed runs left, removed "
                     "before the stages run)") if self.reclaimable else ""  # fmt: skip
        what = (f"stage cache {human(self.cache_bytes)} in {self.cache_dir}, artifact "
                f"{human(self.artifact_bytes)}, and stages' scratch while they run")  # fmt: skip
        if self.same_filesystem:
            checks = [(self.output, self.peak, self.free_output + self.reclaimable, what)]
        else:
            checks = [
                (self.cache_dir, self.cache_peak, self.free_cache + self.reclaimable,
                 "the stage cache, on a filesystem of its own, with stages' scratch"),
                (self.output, self.peak, self.free_output,
                 "the artifact, copied from the stage cache's filesystem"),
            ]  # fmt: skip
        return [
            f"{path}: the compile needs about {human(needed(need))} there at its peak ({what}; "
            f"{MARGIN:.0%} margin included) but {human(free)} is free{leftovers}"
            for path, need, free, what in checks
            if needed(need) > free
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "stage_cache": str(self.cache_dir),
            "same_filesystem": self.same_filesystem,
            "parts": [p.to_dict() for p in self.parts],
            "stage_cache_bytes": self.cache_bytes,
            "artifact_bytes": self.artifact_bytes,
            "kept_bytes": self.total,
            "peak_bytes": self.peak,
            "needed_bytes": needed(self.peak),
            "stage_cache_peak_bytes": self.cache_peak,
            "margin": MARGIN,
            "free_bytes": {"output": self.free_output, "stage_cache": self.free_cache},
            "reclaimable_bytes": self.reclaimable,
        }


def needed(nbytes: int) -> int:
    """`nbytes` with the margin kiln asks on top of its estimate."""
    return math.ceil(nbytes * (1 + MARGIN))


def human(nbytes: int) -> str:
    """Bytes in binary units, as `df -h` and `du -h` print them."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def estimate_disk(
    jobs: list[ModelJob],
    targets: Mapping[str, TargetPlan],
    trtllm_path: str,
    resolved: dict[str, Any],
    output: Path,
    *,
    force: bool = False,
) -> DiskEstimate:
    """What compiling `jobs` (the model, then its draft) for `targets` writes under `output`,
    each stage checked against the stage cache there (`resolved`: the recipe as the package
    stage keys it), or every stage afresh with `force` (`kiln compile --force`)."""
    output = Path(os.path.abspath(output))
    cache_dir = output / CACHE_DIR
    keys = [None if force else stage_keys(job, cache_dir) for job in jobs]
    parts: list[DiskPart] = []
    for job, job_keys in zip(jobs, keys, strict=True):
        parts += _stage_parts(job, targets, job_keys, cache_dir)
    # the package stage is looked up where there is no draft (whose key needs its measurements)
    published = len(jobs) == 1 and packaged(keys[0], resolved, cache_dir)
    for job in jobs:
        parts += [_cached(p, published) for p in _artifact_parts(job, targets, trtllm_path)]
    out_fs, cache_fs = existing(output), existing(cache_dir)
    return DiskEstimate(
        output=output,
        cache_dir=cache_dir,
        parts=tuple(parts),
        same_filesystem=out_fs.stat().st_dev == cache_fs.stat().st_dev,
        free_output=shutil.disk_usage(out_fs).free,
        free_cache=shutil.disk_usage(cache_fs).free,
        reclaimable=leftover_bytes(output),
    )


def _cached(part: DiskPart, cached: bool) -> DiskPart:
    return dataclasses.replace(part, cached=True) if cached else part


def _stage_parts(
    job: ModelJob, targets: Mapping[str, TargetPlan], keys: dict[str, str] | None, cache_dir: Path
) -> list[DiskPart]:
    """The job's stages in the order they run, each with what it keeps and its scratch."""
    info, scheme, width = job.info, job.scheme, _source_width(job)
    small = _small_files(job)
    cache = StageCache(cache_dir) if keys else None

    def part(stage: str, nbytes: int, note: str = "", scratch: int = 0) -> DiskPart:
        name = job.stage(stage)
        key = (keys or {}).get(name)  # the draft's nested package: not looked up
        found = cache.lookup(name, key) if cache is not None and key else None
        return DiskPart(name, nbytes + SLACK, "cache", note, found is not None, scratch)

    if used_in_place(job.source):
        out = [part("source", 0, f"used in place: {job.source.path}")]
    else:
        note = f"{job.source.kind} converted to {_source_dtype(job)}"
        out = [part("source", float_bytes(info, width) + small, note)]
    # method none copies the float checkpoint without loading it
    offloads = job.imported is None and scheme.name != "NO_QUANT"
    offloads = offloads and BACKENDS[scheme.spec.backend].offloads_for(scheme.name)
    offload = offload_bytes(info, scheme, width) if offloads else 0
    logprobs = _report_logprobs(job)
    # the report's float half is computed beside the quantiser only from a size on
    # (compiler/pipeline.py `_reference_beside`); below it the report computes it itself
    beside = logprobs if job.info.num_parameters >= REFERENCE_BESIDE_MIN_PARAMETERS else 0
    note = f"{scheme.label} checkpoint" + (", offloading while calibrating" if offload else "")
    note += ", the report's float log-probabilities beside it" if beside else ""
    out.append(part("quantize", _quantised_bytes(job), note, offload + beside))
    if job.report is not None:
        note = "float log-probabilities while it runs" if logprobs else ""
        out.append(part("report", report_bytes(info), note, logprobs))
    for tp in job.tps:
        users = ", ".join(n for n, t in targets.items() if t.tp_size == tp)
        # written while the report runs beside it, its log-probabilities on disk meanwhile
        note = f"for {users}" + (", beside the report" if logprobs else "")
        out.append(part(f"export-tp{tp}", export_bytes(info, scheme, tp), note, logprobs))
    if job.role:  # the nested artifact: links to the draft's stages, and its manifest
        out.append(part("package", 0, "nested artifact: hard links"))
    return out


def _report_logprobs(job: ModelJob) -> int:
    """The report's held-out tokens × vocabulary float32 log-probabilities on disk while the
    report runs: computed beside the quantiser (compiler/float_reference.py) and kept until the
    report has read them, or computed by the report itself."""
    if job.report is None or job.imported:
        return 0
    return job.report.num_samples * job.report.max_seq_len * job.info.vocab_size * 4


def _artifact_parts(
    job: ModelJob, targets: Mapping[str, TargetPlan], trtllm_path: str
) -> list[DiskPart]:
    """The artifact: the stage outputs it links, and the files only it holds."""
    info, scheme = job.info, job.scheme
    where = f"{job.role}/" if job.role else ""
    linked = _quantised_bytes(job)
    exports = {tp: export_bytes(info, scheme, tp) for tp in job.tps}
    out = [DiskPart(f"{where}model/, {where}trtllm/tp*/", linked + sum(exports.values()), "link",
                    "hard links into the stage cache")]  # fmt: skip
    # compiler/trtllm/deploy.py `_convert`: a compressed-tensors checkpoint the PyTorch backend
    # does not load is converted to ModelOpt's HF format for the artifact, unless it has zero
    # points (export/modelopt_hf.py refuses them at once); the model's is written beside the
    # report (compiler/compile.py `PackageAhead`), the report's log-probabilities on disk
    fmt = _format(job)
    algo = scheme.trtllm_quant_algo
    converts = fmt == "compressed-tensors" and pytorch_problem(fmt, algo) is not None
    converts = converts and scheme.symmetric
    if targets and trtllm_path != "engine" and converts:
        hf = "trtllm/hf-draft/" if job.role else "trtllm/hf/"
        beside = job.report is not None and not job.imported and not job.role
        logprobs = _report_logprobs(job) if beside else 0
        note = "ModelOpt HF conversion for the PyTorch path"
        note += ", beside the report" if beside else ""
        out.append(DiskPart(hf, linked + SLACK, "artifact", note, scratch=logprobs))
    if job.role:
        return out
    report = report_bytes(info) if job.report is not None else 0
    out.append(DiskPart("reports/, manifest, engines/*/ plans", report + SLACK * (1 + len(targets)),
                        "artifact"))  # fmt: skip
    # engines are built only where TensorRT-LLM 1.2 is installed (compiler/trtllm/build)
    builder = (version("tensorrt_llm", "tensorrt-llm") or "").startswith(TRTLLM_LINE)
    if builder and trtllm_path != "pytorch":
        for name, target in targets.items():
            if not target.engine_problems:
                out.append(DiskPart(f"engines/{name}/", exports[target.tp_size], "artifact",
                                    "built here: counted as its checkpoint's size"))  # fmt: skip
    return out


def _format(job: ModelJob) -> str:
    """The format of the quantised checkpoint: float, compressed-tensors for an import
    (quant/prequantized converts it), else the backend's."""
    if job.scheme.name == "NO_QUANT":
        return "float"
    if job.imported is not None:
        return "compressed-tensors"
    return BACKENDS[job.scheme.spec.backend].format


def _source_dtype(job: ModelJob) -> str:
    """The float dtype of the checkpoint the quantiser reads (and keeps float parts in)."""
    if job.source.kind in (sources.GGUF, sources.BUILTIN):
        return "float32"  # dequantised so
    return calibration_dtype(job.info.torch_dtype)


def _source_width(job: ModelJob) -> int:
    return DTYPE_BYTES[_source_dtype(job)]


def _quantised_bytes(job: ModelJob) -> int:
    """The quantise stage's checkpoint (`model/` of the artifact)."""
    found = hf_checkpoint_bytes(job.info, job.scheme, _source_width(job)) + _small_files(job)
    if job.scheme.name == "NO_QUANT" and used_in_place(job.source):  # the folder copied whole
        return max(found, _folder_bytes(job.source.path))
    return found


def _folder_bytes(path: Path) -> int:
    """The sizes of the files under `path`, through links (a hub snapshot's are)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _small_files(job: ModelJob) -> int:
    """Configs and tokenizer a checkpoint copy carries: the source's own, or (re-serialised
    from a vocabulary, as a GGUF's is) a bound from the vocabulary's size."""
    written = job.info.vocab_size * TOKENIZER_BYTES_PER_TOKEN
    path = job.source.path
    if not path.is_dir():
        return written
    found = {p for pattern in SMALL_FILES for p in path.glob(pattern) if p.is_file()}
    return max(written, sum(p.stat().st_size for p in found))
