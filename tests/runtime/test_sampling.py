"""Per-request sampling: greedy, temperature, top-k, top-p, seeds, stops, log-probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.runtime import Engine, SamplingParams
from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.sampling import make_generator, sample
from tests.runtime.conftest import prompt_ids


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Engine:
    return Engine.from_pretrained(tiny_llama)


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_sampler_draws_from_the_softmax_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = sample(logits, params, [None] * 4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


def test_top_k_and_top_p_truncate_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2000, 1)
    top_k = sample(logits, [SamplingParams(top_k=2)] * 2000, [None] * 2000)
    assert set(top_k.tolist()) == {0, 1}
    # Mass before token 1 is 0.4 < 0.5, before token 2 it is 0.7: the nucleus is {0, 1}.
    top_p = sample(logits, [SamplingParams(top_p=0.5)] * 2000, [None] * 2000)
    assert set(top_p.tolist()) == {0, 1}


def test_seeded_rows_ignore_their_batch_neighbours() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(seed=7), SamplingParams(), SamplingParams(temperature=0)]
    together = sample(logits, params, [make_generator(p.seed) for p in params])
    alone = sample(logits[:1], params[:1], [make_generator(7)])
    assert together[0] == alone[0]
    assert together[2] == logits[2].argmax()


def test_seed_reproduces_a_request_in_any_batch(engine: Engine, tiny_llama: Path) -> None:
    prompts = prompt_ids(tiny_llama)
    seeded = SamplingParams(max_tokens=16, temperature=1.5, seed=123, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0]
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 3
    batched = engine.generate(prompts, [seeded, *others])[0]
    assert batched.token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=16, temperature=1.5, seed=124, ignore_eos=True)
    assert engine.generate([prompts[0]], other_seed)[0].token_ids != alone.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine: Engine, tiny_llama: Path) -> None:
    prompt = prompt_ids(tiny_llama, 1)
    expected = engine.generate(prompt, greedy())[0].token_ids
    top_k = SamplingParams(max_tokens=24, top_k=1, ignore_eos=True, seed=1)
    top_p = SamplingParams(max_tokens=24, top_p=1e-6, ignore_eos=True, seed=1)
    assert engine.generate(prompt, top_k)[0].token_ids == expected
    assert engine.generate(prompt, top_p)[0].token_ids == expected


def test_sampled_tokens_stay_inside_top_k(engine: Engine, tiny_llama: Path) -> None:
    params = SamplingParams(
        max_tokens=40, temperature=5.0, top_k=3, seed=0, logprobs=0, ignore_eos=True
    )
    out = engine.generate(prompt_ids(tiny_llama, 1), params)[0]
    assert out.logprobs is not None
    ranks = [entry[token].rank for entry, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert max(ranks) <= 3 and len(set(ranks)) > 1


def test_stop_string_cuts_the_text(engine: Engine, tiny_llama: Path) -> None:
    prompt = prompt_ids(tiny_llama, 1)
    full = engine.generate(prompt, greedy(32))[0].text
    stop = full[10:13]
    cut = engine.generate(prompt, greedy(32, stop=[stop]))[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = engine.generate(prompt, greedy(32, stop=stop, include_stop_str_in_output=True))[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(engine: Engine, tiny_llama: Path) -> None:
    prompt = prompt_ids(tiny_llama, 1)
    tokens = engine.generate(prompt, greedy(24))[0].token_ids
    stop_token = tokens[5]
    out = engine.generate(prompt, greedy(24, stop_token_ids=[stop_token]))[0]
    assert out.token_ids == tokens[: tokens.index(stop_token) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    eos_engine = Engine.from_pretrained(tiny_llama)
    eos_engine.eos_token_ids = frozenset({stop_token})
    ended = eos_engine.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0]
    assert ended.token_ids == out.token_ids and ended.finish_reason == "stop"
    assert ended.stop_reason is None


def test_max_tokens_ends_with_length(engine: Engine, tiny_llama: Path) -> None:
    out = engine.generate(prompt_ids(tiny_llama, 1), greedy(7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_invalid_params_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(UsageError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(UsageError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1e-3, top_k=5),
        SamplingParams(top_p=1e-300),
        SamplingParams(temperature=0.5, top_p=1e-45),
    ],
    ids=[
        "temperature-1e-40",
        "temperature-1e-6",
        "small-temperature-top-k",
        "top-p-1e-300",
        "top-p-subnormal",
    ],
)
def test_numerically_tiny_settings_sample_as_greedy_does(params: SamplingParams) -> None:
    logits = torch.tensor([[3.0, 9.0, -2.0, 8.5, 0.0]]).repeat(64, 1)
    tokens = sample(logits, [params] * 64, [None] * 64)
    assert tokens.tolist() == [1] * 64  # the argmax, never a NaN's token


def test_a_tiny_temperature_generates_the_greedy_continuation(
    engine: Engine, tiny_llama: Path
) -> None:
    prompt = prompt_ids(tiny_llama, 1)[0]
    want = engine.generate([prompt], greedy(max_tokens=12))[0].token_ids
    for params in (SamplingParams(temperature=1e-40), SamplingParams(top_p=1e-300)):
        params.max_tokens, params.ignore_eos = 12, True
        assert engine.generate([prompt], params)[0].token_ids == want
