"""lm-eval model `kiln`: scores through the runtime match lm-eval's transformers model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from kiln.gates.measure.lm_eval_adapter import KilnLM, hf_source_lm, hf_topk_logprobs, main
from tests.gates.conftest import build_artifact

TEXT = "Permission is hereby granted, free of charge, to any person obtaining a copy"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sides(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[KilnLM, object]:
    art = build_artifact(tmp_path_factory.mktemp("arts"), name="tiny", model_dir=tiny_llama)
    kiln = get_model("kiln").create_from_arg_string(f"artifact={art},max_length=64")
    return kiln, hf_source_lm(tiny_llama, max_length=kiln.max_length)


def requests(kind: str, args: list[tuple[object, ...]]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]  # type: ignore[arg-type]


def test_kiln_is_registered_with_lm_eval(sides: tuple[KilnLM, object]) -> None:
    kiln, _ = sides
    assert get_model("kiln") is KilnLM
    assert isinstance(kiln, KilnLM) and kiln.max_length == 64


def test_loglikelihood_matches_transformers(sides: tuple[KilnLM, object]) -> None:
    kiln, hf = sides
    args = [("Permission is hereby", " granted"), ("", "free of charge"), (TEXT, " to")]
    ours = kiln.loglikelihood(requests("loglikelihood", args))
    theirs = hf.loglikelihood(requests("loglikelihood", args))  # type: ignore[attr-defined]
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-3) and greedy_a == greedy_b


def test_choices_of_one_context_score_it_once_and_match_transformers(
    sides: tuple[KilnLM, object],
) -> None:
    kiln, hf = sides
    context = f"{TEXT} of this software"
    args = [(context, c) for c in (" to", " and", " of the", " granted")]
    hits_before = kiln.engine.stats().prefix_cache_hits
    ours = kiln.loglikelihood(requests("loglikelihood", args))
    theirs = hf.loglikelihood(requests("loglikelihood", args))  # type: ignore[attr-defined]
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=1e-3) and greedy_a == greedy_b
    # the three choices after the first read the context's full blocks from the prefix cache
    context_len = len(kiln.tok_encode(context))
    block = kiln.engine.config.block_size
    cached = kiln.engine.stats().prefix_cache_hits - hits_before
    assert cached >= 3 * ((context_len - 1) // block) * block > 0


def test_rolling_loglikelihood_uses_the_same_windows(sides: tuple[KilnLM, object]) -> None:
    kiln, hf = sides
    long_text = " ".join([TEXT] * 8)  # longer than max_length: several windows
    assert len(kiln.tok_encode(long_text)) > 2 * kiln.max_length
    ours = kiln.loglikelihood_rolling(requests("loglikelihood_rolling", [(long_text,)]))
    theirs = hf.loglikelihood_rolling(  # type: ignore[attr-defined]
        requests("loglikelihood_rolling", [(long_text,)])
    )
    assert ours[0] == pytest.approx(theirs[0], rel=1e-4)


def test_greedy_generation_matches_transformers(sides: tuple[KilnLM, object]) -> None:
    kiln, hf = sides
    args = [("Permission is", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            (TEXT, {"until": ["the"], "max_gen_toks": 16})]  # fmt: skip
    ours = kiln.generate_until(requests("generate_until", args))
    theirs = hf.generate_until(requests("generate_until", args))  # type: ignore[attr-defined]
    assert ours == theirs and all("the" not in text for text in ours[1:])


def test_topk_logprobs_align_position_for_position(sides: tuple[KilnLM, object]) -> None:
    kiln, hf = sides
    ids = [kiln.tok_encode(TEXT)]
    ours, theirs = kiln.topk_logprobs(ids, 5), hf_topk_logprobs(hf, ids, 5)
    assert len(ours[0]) == len(theirs[0]) == len(ids[0]) - 1
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert set(a) == set(b)
        assert max(abs(a[t] - b[t]) for t in a) < 1e-3


def test_the_module_runs_lm_evals_cli_on_kiln_task_files(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    art = build_artifact(tmp_path / "arts", name="tiny", model_dir=tiny_llama)
    tasks = Path(__file__).resolve().parents[2] / "recipes" / "tasks"
    main(["run", "--model", "kiln", "--model_args", f"artifact={art},max_length=64",
          "--include_path", str(tasks), "--tasks", "kiln_mc", "--limit", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert "|kiln_mc|" in out and "acc" in out
