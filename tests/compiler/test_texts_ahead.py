"""A compile of a source kiln has not hashed yet reads its report's held-out texts on a thread of
their own while the source is hashed (compiler/pipeline.py `_texts_ahead`): the same texts, and
an error in reading them still met where it was before, by the compile's own read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.compiler import pipeline, sources
from kiln.compiler.compile import model_job
from kiln.compiler.preflight import run_preflight
from kiln.compiler.recipe.recipe import load_recipe


def job_for(tmp_path: Path, model: Path) -> pipeline.ModelJob:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: ahead\nmodel:\n  source: {model}\nquantization:\n  method: fp8\n"
        "calibration:\n  dataset: builtin:licenses\n  num_samples: 4\n  max_seq_len: 64\n"
        "report:\n  dataset: builtin:licenses\n  num_samples: 2\n  max_seq_len: 64\n"
        "targets: [h100-sxm]\noutput: out\n"
    )
    return model_job(run_preflight(load_recipe(path), check_memory=False))


def test_texts_read_beside_the_hash_are_the_texts_the_report_reads(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    job = job_for(tmp_path, model)
    ahead = pipeline._texts_ahead(job, True)
    assert ahead is not None
    texts = ahead.result()
    assert texts and texts == pipeline._report_texts(job, model, True)
    sources.source_digest(job.source)
    assert pipeline._texts_ahead(job, True) is None  # hashed: nothing to read beside


def test_a_failed_read_ahead_leaves_the_error_to_the_compiles_own_read(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    job = job_for(tmp_path, model)

    def broken(*_: object) -> list[str]:
        raise OSError("the report's data went away")

    monkeypatch.setattr(pipeline, "_report_texts", broken)
    ahead = pipeline._texts_ahead(job, True)
    assert ahead is not None and ahead.result() is None


def test_the_source_is_hashed_with_the_cycle_collector_paused(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hash runs beside the texts' imports (transformers', a tokenizer's): objects that
    live on, which the collector would scan again and again as the heap grows. It is on again
    after, also where the hash fails."""
    import gc

    from kiln.compiler.stages import StageCache

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    job = job_for(tmp_path, model)
    seen: list[bool] = []

    def digest(_: object) -> str:
        seen.append(gc.isenabled())
        raise OSError("the source went away")

    monkeypatch.setattr(sources, "source_digest", digest)
    with pytest.raises(OSError, match="went away"):
        pipeline.build_model(job, StageCache(tmp_path / "cache"), {})
    assert seen == [False] and gc.isenabled()
