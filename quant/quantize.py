"""Quantisation: schemes, calibration data, backends, and the error report.

`quantize()` is the one entry point the compiler's quantise stage calls: float Hugging Face
checkpoint in, quantised Hugging Face checkpoint out (compressed-tensors or ModelOpt).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant import calibration as calib_data
from kiln.quant.backends.base import Backend, QuantJob
from kiln.quant.schemes import check
from kiln.quant.spec import CalibrationSpec, Scheme, calibration_dtype
from kiln.runtime.base.errors import CalibrationDataError, PreflightError, StageFailure
from kiln.runtime.base.heap import return_large_frees
from kiln.runtime.base.versions import versions
from kiln.runtime.formats.artifact import CalibrationRecord, SchemeRecord
from kiln.runtime.formats.tokenizer_files import save_tokenizer

if TYPE_CHECKING:
    from kiln.runtime.formats.model_info import ModelInfo


def moe_calibration_problem(
    info: ModelInfo, scheme: Scheme, calibration: CalibrationSpec
) -> str | None:
    """Why `calibration.moe_experts: all` cannot be honoured (None where it can, or is not
    asked): only llm-compressor runs every expert on every calibration token."""
    backend = scheme.spec.backend
    if (info.moe is None or not scheme.needs_calibration or calibration.moe_experts != "all"
            or backend == "llmcompressor"):  # fmt: skip
        return None
    return (f"all: backend {backend} calibrates each expert on the tokens routed to it only; "
            "set calibration.moe_experts: warn or fail, or use backend: llmcompressor")  # fmt: skip


def quantize(
    model_dir: Path,
    scheme: Scheme,
    calibration: CalibrationSpec,
    out_dir: Path,
    *,
    progress: Callable[[str], None] | None = None,
    routing_out: Path | None = None,
) -> SchemeRecord:
    """Quantise the float checkpoint in `model_dir` into the empty directory `out_dir` with
    `scheme` (preflight resolved it; its `spec` carries the backend and the ignore list).

    Returns the manifest's `scheme` record: scheme, backend, format, TensorRT-LLM algorithm
    names, calibration data, library versions and seconds taken. Raises PreflightError or
    CalibrationDataError for a spec or data that cannot work (before loading the model) and
    StageFailure when the quantisation library fails. For a mixture-of-experts model the
    tokens routed to each expert are counted first (quant/moe_routing.py) and written as JSON
    to `routing_out`; `calibration.moe_experts: fail` refuses starved experts there.
    """
    from kiln.quant.backends import BACKENDS
    from kiln.runtime.formats.model_info import ModelInfo

    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    info = ModelInfo.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    spec = scheme.spec
    problems = check(spec, info)  # the model at hand: its shapes against the group size
    if problems:
        raise PreflightError("\n".join(str(p) for p in problems))
    backend = BACKENDS[spec.backend]
    record = scheme_record(scheme, backend)
    if scheme.name == "NO_QUANT":
        say("method none: copying the float checkpoint")
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
        _spell_legacy_rope(out_dir / "config.json")
        record.seconds = round(time.perf_counter() - start, 3)
        return record

    if (why := moe_calibration_problem(info, scheme, calibration)) is not None:
        raise PreflightError(f"calibration.moe_experts: {why}")
    if scheme.needs_calibration:
        problems = calib_data.check(calibration)
        if problems:
            raise CalibrationDataError("\n".join(str(p) for p in problems))

    import torch
    from transformers import AutoTokenizer

    return_large_frees()  # layers are loaded and freed one after another
    dtype = getattr(torch, calibration_dtype(info.torch_dtype))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Offloaded weights are written beside the output (one filesystem), never into it.
    with tempfile.TemporaryDirectory(prefix=".offload-", dir=out_dir.parent) as offload:
        say(f"loading {model_dir} ({dtype}) for {backend.name}")
        model = backend.load(model_dir, dtype, Path(offload), scheme)
        _calibrate(model, tokenizer, info, scheme, calibration, backend, record, out_dir,
                   routing_out, say)  # fmt: skip
        del model
    save_tokenizer(tokenizer, out_dir)
    _spell_legacy_rope(out_dir / "config.json")
    source_generation = model_dir / "generation_config.json"
    if source_generation.is_file() and not (out_dir / "generation_config.json").exists():
        shutil.copy2(source_generation, out_dir / "generation_config.json")
    record.seconds = round(time.perf_counter() - start, 3)
    return record


def _calibrate(
    model: Any,
    tokenizer: Any,
    info: ModelInfo,
    scheme: Scheme,
    calibration: CalibrationSpec,
    backend: Backend,
    record: SchemeRecord,
    out_dir: Path,
    routing_out: Path | None,
    say: Callable[[str], None],
) -> None:
    """Calibrate and quantise `model` with `backend`, saving the result into `out_dir`."""
    import torch

    spec = scheme.spec
    samples: list[list[int]] = []
    if scheme.needs_calibration:
        samples, record.calibration = calibration_samples(calibration, tokenizer)
        if info.moe is not None:
            _count_routing(model, info, samples, calibration, routing_out, say)
        say(f"calibrating {scheme.label} with {backend.name} on {len(samples)} samples")
    else:
        say(f"quantising {scheme.label} with {backend.name} (no calibration data needed)")
    try:
        with torch.no_grad():
            everything = calibration.moe_experts == "all"
            backend.run(QuantJob(model, tokenizer, scheme, spec, samples, out_dir, say, everything))
    except Exception as exc:
        raise StageFailure(
            f"{backend.name} failed to produce {scheme.label} from {model.name_or_path}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _spell_legacy_rope(path: Path) -> None:
    """config.json as written, plus its RoPE as transformers 4 reads it (TensorRT-LLM 1.2's
    loader runs transformers 4.57: model_info.with_legacy_rope)."""
    from kiln.runtime.formats.model_info import with_legacy_rope

    config = json.loads(path.read_text())
    spelled = with_legacy_rope(config)
    if spelled != config:
        path.write_text(json.dumps(spelled, indent=2, sort_keys=True) + "\n")


def _count_routing(
    model: Any,
    info: ModelInfo,
    samples: list[list[int]],
    calibration: CalibrationSpec,
    out: Path | None,
    say: Callable[[str], None],
) -> None:
    """Count the calibration tokens each expert is routed; refuse starved ones under `fail`."""
    from kiln.quant.moe_routing import routed_tokens, routing_report, starved_problem

    say(f"counting the calibration tokens routed to each of {info.num_experts} experts")
    counts = routed_tokens(model, info, samples)
    report = routing_report(counts, info, calibration.moe_min_tokens, calibration.moe_experts)
    if out is not None:
        out.write_text(json.dumps(report, indent=2))
    starved = report["starved"]
    if starved and calibration.moe_experts == "fail":
        raise CalibrationDataError(starved_problem(report) or "")
    if starved:
        policy = calibration.moe_experts
        say(f"{len(starved)} expert(s) routed fewer than {calibration.moe_min_tokens} tokens "
            f"(calibration.moe_experts: {policy}); the report lists them")  # fmt: skip


def scheme_record(scheme: Scheme, backend: Backend) -> SchemeRecord:
    """The manifest's `scheme` record of what `backend` makes of `scheme` (before timing and
    calibration are known)."""
    quantised = scheme.name != "NO_QUANT"
    return SchemeRecord(
        scheme=scheme.name,
        label=scheme.label,
        backend=backend.name,
        format=backend.format if quantised else "float",
        trtllm_quant_algo=scheme.trtllm_quant_algo,
        trtllm_kv_cache_quant_algo=scheme.trtllm_kv_cache_quant_algo,
        group_size=scheme.group_size,
        symmetric=scheme.symmetric,
        activations=scheme.activations,
        kv_cache=scheme.kv_cache,
        ignore=list(scheme.spec.ignore),
        versions=versions(("torch", "transformers", *(backend.packages if quantised else ()))),
    )


def calibration_samples(
    calibration: CalibrationSpec, tokenizer: Any
) -> tuple[list[list[int]], CalibrationRecord]:
    """The calibration passages as token ids, and the record of what they were."""
    texts = calib_data.load_texts(calibration, tokenizer)
    samples = calib_data.tokenize(texts, tokenizer, calibration.max_seq_len)
    return samples, CalibrationRecord(
        dataset=calibration.dataset,
        digest=calib_data.dataset_digest(calibration),
        num_samples=len(samples),
        tokens=sum(map(len, samples)),
        max_seq_len=calibration.max_seq_len,
        seed=calibration.seed,
    )
