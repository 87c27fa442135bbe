"""Speculative decoding: exactness (greedy and sampled), KV rollback, opt-outs, n-gram, auto-K."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from kiln.compiler.draft.acceptance import measure_acceptance
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.sampling import probabilities
from kiln.runtime.engine.spec_decode.rejection import rejection_sample
from kiln.runtime.engine.spec_decode.speculator import (
    SpeculativeConfig,
    choose_draft_len,
    expected_speedup,
    expected_tokens_per_pass,
    ngram_propose,
)
from kiln.runtime.formats.artifact import (
    MODEL_DIR,
    Manifest,
    SpeculativeRecord,
    assemble,
    write_manifest,
)
from tests.runtime.conftest import PROMPTS, hf_model, prompt_ids
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def shallow_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama's first layer plus its embedding and head (same seed, same parameter names)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft-1layer"), num_layers=1)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A differently seeded model with the same tokenizer: a poor draft, so rejections happen."""
    return make_tiny_model(tmp_path_factory.mktemp("draft-other"), seed=1)


def spec(draft: Path | None = None, k: int = 3, **options: object) -> SpeculativeConfig:
    method = "draft" if draft is not None else "ngram"
    return SpeculativeConfig(
        method=method,
        draft=draft,
        num_speculative_tokens=k,
        disable_by_batch_size=options.pop("disable_by_batch_size", 64),  # type: ignore[arg-type]
        **options,  # type: ignore[arg-type]
    )


def test_greedy_output_is_plain_greedy_output(
    tiny_llama: Path, shallow_draft: Path, other_draft: Path
) -> None:
    params = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True, logprobs=2)
    plain = Engine.from_pretrained(tiny_llama, block_size=4).generate(PROMPTS, params)
    # (draft, whether it agrees with the target everywhere): itself, its first layer, a
    # differently seeded model, prompt lookup.
    cases = [(tiny_llama, True), (shallow_draft, False), (other_draft, False), (None, False)]
    for draft, agrees in cases:
        config = spec(draft, k=4 if draft == shallow_draft else 3)
        engine = Engine.from_pretrained(tiny_llama, block_size=4, speculative=config)
        outputs = engine.generate(PROMPTS, params)
        for want, got in zip(plain, outputs, strict=True):
            assert got.token_ids == want.token_ids
            assert got.text == want.text
            assert want.logprobs is not None and got.logprobs is not None
            for a, b in zip(want.logprobs, got.logprobs, strict=True):
                assert a.keys() == b.keys()
                for token in a:
                    assert abs(a[token].logprob - b[token].logprob) < 1e-4
        stats = engine.stats()
        assert stats.spec_decode_num_drafts > 0
        assert stats.generation_tokens_total == len(PROMPTS) * params.max_tokens
        accepted, drafted = (
            stats.spec_decode_num_accepted_tokens,
            stats.spec_decode_num_draft_tokens,
        )
        assert (accepted == drafted) == agrees


def test_stop_rules_hold_inside_an_accepted_run(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reference = Engine.from_pretrained(tiny_llama).generate(PROMPTS[:1], greedy)[0]
    stop_token = reference.token_ids[6]
    stop_text = reference.text[len(reference.text) // 2 :][:6]
    cases = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ]
    plain = Engine.from_pretrained(tiny_llama)
    # A self-draft accepts every token, so each stop falls inside a run of k + 1 tokens.
    fast = Engine.from_pretrained(tiny_llama, speculative=spec(tiny_llama, k=5))
    for params in cases:
        want = plain.generate(PROMPTS[:1], params)[0]
        got = fast.generate(PROMPTS[:1], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
    assert len(got.token_ids) == 7
    assert fast.stats().spec_decode_num_accepted_tokens == fast.stats().spec_decode_num_draft_tokens


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    vocab, k, draws = 6, 2, 6000
    target = torch.softmax(torch.randn(k + 1, vocab) * 1.5, dim=-1)
    draft = torch.softmax(torch.randn(k, vocab) * 1.5, dim=-1)
    generator = torch.Generator().manual_seed(1)
    counts = {"model": torch.zeros(vocab), "one-hot": torch.zeros(vocab)}
    for _ in range(draws):
        drafts = torch.multinomial(draft, 1, generator=generator).flatten().tolist()
        first = rejection_sample(target, draft, drafts, generator)[0]
        counts["model"][first] += 1
        # A deterministic proposer (q one-hot at its token) must be exact too.
        first = rejection_sample(target, None, [1, 2], generator)[0]
        counts["one-hot"][first] += 1
    for observed in counts.values():
        assert chisquare(observed, target[0] * draws).pvalue > 1e-3


def test_speculative_sampling_matches_the_target(tiny_llama: Path, shallow_draft: Path) -> None:
    """Chi-square on the joint law of the first four sampled tokens over many seeds. The
    draft (the target's first layer) shares some but not all of the target's top-2 support,
    so acceptances, rejections with resampling, and bonus tokens all happen."""
    prompt = prompt_ids(tiny_llama, 1)[0]
    draws = 3000
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=seed, ignore_eos=True)
        for seed in range(draws)
    ]
    engine = Engine.from_pretrained(
        tiny_llama,
        max_num_seqs=256,
        speculative=spec(shallow_draft, k=2, disable_by_batch_size=512),
    )
    outputs = engine.generate([prompt] * draws, params)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens_per_pos[-1] > 0  # bonus tokens were drawn

    # The exact law of the first four tokens under top-2, temperature-1 sampling of the target.
    reference = hf_model(tiny_llama)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(4):
        grown = {}
        for prefix, mass in law.items():
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + list(prefix)])).logits[0, -1:]
            probs = probabilities(logits.float(), [params[0]])[0]
            for token in probs.topk(2).indices.tolist():
                grown[(*prefix, token)] = mass * float(probs[token])
        law = grown
    observed = {key: 0 for key in law}
    for out in outputs:
        observed[tuple(out.token_ids)] += 1  # KeyError: a token outside the top-2 support
    keys = sorted(law)
    expected = torch.tensor([law[key] for key in keys], dtype=torch.float64)
    counts = torch.tensor([observed[key] for key in keys], dtype=torch.float64)
    assert chisquare(counts, expected / expected.sum() * draws).pvalue > 1e-3


def held_blocks(engine: Engine) -> tuple[int, int]:
    """Blocks held in the target and the draft pools, asserting each sequence holds exactly
    what its computed tokens need."""
    kv = engine.kv
    for request in engine.scheduler.running:
        assert len(request.block_table) == kv.blocks_needed(request.num_computed_tokens)
    assert engine.speculator is not None and engine.speculator.proposer is not None
    draft = engine.speculator.proposer
    for state in draft.sequences.values():
        sequence = state.request
        assert len(sequence.block_table) == draft.kv.blocks_needed(sequence.num_computed_tokens)
    target_held = sum(len(r.block_table) for r in engine.scheduler.running)
    draft_held = sum(len(s.request.block_table) for s in draft.sequences.values())
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - target_held
    assert draft.kv.pool.num_free_blocks == draft.kv.pool.num_blocks - draft_held
    return target_held, draft_held


def test_rollback_leaves_block_counts_exact(tiny_llama: Path, other_draft: Path) -> None:
    engine = Engine.from_pretrained(
        tiny_llama, block_size=4, enable_prefix_caching=False, speculative=spec(other_draft, k=4)
    )
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=i, ignore_eos=True)
        for i, t in enumerate((0, 0.8, 1.0, 0))
    ]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        target_held, draft_held = held_blocks(engine)
        if steps == 3:
            assert target_held > 0 and draft_held > 0
            assert engine.abort(ids[1])  # an abort frees both caches at once
            held_blocks(engine)
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert engine.speculator is not None and engine.speculator.proposer is not None
    draft_pool = engine.speculator.proposer.kv.pool
    assert draft_pool.num_free_blocks == draft_pool.num_blocks
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.speculator.proposer.sequences


def test_preemption_under_a_small_pool_stays_exact(tiny_llama: Path, shallow_draft: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = Engine.from_pretrained(tiny_llama, block_size=4).generate(PROMPTS, params)
    engine = Engine.from_pretrained(
        tiny_llama, block_size=4, num_blocks=40, speculative=spec(shallow_draft, k=4)
    )
    outputs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert engine.stats().num_preemptions > 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_opt_out_and_batch_size_fallback(tiny_llama: Path, shallow_draft: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    opted_out = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, speculative=False)
    engine = Engine.from_pretrained(tiny_llama, speculative=spec(shallow_draft))
    engine.generate(PROMPTS[:2], opted_out)
    assert engine.stats().spec_decode_num_drafts == 0
    engine.generate(PROMPTS[:2], [opted_out, greedy])
    drafts = engine.stats().spec_decode_num_drafts
    assert 0 < drafts <= greedy.max_tokens

    crowded = Engine.from_pretrained(
        tiny_llama, speculative=spec(shallow_draft, disable_by_batch_size=2)
    )
    crowded.generate(PROMPTS[:3], greedy)  # three running > 2: plain decoding throughout
    assert crowded.stats().spec_decode_num_drafts == 0
    crowded.generate(PROMPTS[:2], greedy)
    assert crowded.stats().spec_decode_num_drafts > 0


def test_ngram_lookup_proposes_what_followed_the_latest_match() -> None:
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    assert ngram_propose(tokens, 3, 1, 4) == [3, 4, 2]  # latest earlier "6 7"
    assert ngram_propose([4, 1, 2, 8, 5, 1, 2, 6, 4, 1, 2], 2, 1, 3) == [8, 5]  # longest n wins
    assert ngram_propose([1, 2, 3, 4], 3, 1, 4) == []
    assert ngram_propose([7, 7], 4, 1, 4) == [7]
    # Byte-level search must not match across token boundaries.
    assert ngram_propose([256, 0, 5, 1], 2, 1, 1) == []
    assert ngram_propose([1, 9, 256, 0, 5, 1], 2, 1, 1) == [9, 256]


def test_ngram_mode_speeds_up_an_extractive_prompt(tiny_llama: Path) -> None:
    # A random tiny model falls into loops; prompt lookup drafts them for free.
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompt = prompt_ids(tiny_llama, 1)[0] * 3
    plain = Engine.from_pretrained(tiny_llama)
    lookup = Engine.from_pretrained(tiny_llama, speculative=spec(None, k=4))
    assert (
        lookup.generate([prompt], params)[0].token_ids
        == plain.generate([prompt], params)[0].token_ids
    )
    assert lookup.stats().spec_decode_num_accepted_tokens > 0
    assert lookup.stats().num_steps < plain.stats().num_steps


def test_stats_fields_add_up(tiny_llama: Path, other_draft: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, speculative=spec(other_draft, k=3))
    engine.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = engine.stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 3 and sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position i needs all before it
    assert stats.spec_decode_num_draft_tokens <= 3 * stats.spec_decode_num_drafts
    mean = 1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts
    assert stats.spec_decode_mean_acceptance_length == pytest.approx(mean)
    # One verifying pass per draft, each emitting accepted + 1 tokens (prefill emits one).
    emitted = stats.spec_decode_num_accepted_tokens + stats.spec_decode_num_drafts
    assert emitted <= stats.generation_tokens_total - len(PROMPTS)


def test_auto_k_picks_the_analytic_optimum() -> None:
    # Leviathan et al.'s example: a = 0.8, k = 4, c = 0.1 gives 3.36 tokens, 2.4x.
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert expected_tokens_per_pass(1.0, 3) == 4
    # Speedups by k for (a, c), worked by hand: (0.8, 0.1) peaks at k = 6 (2.470 vs 2.459
    # at 5, 2.448 at 7); (0.5, 0.5) at k = 1 (1.0 vs 0.875); (0.9, 0.05) still climbs at 8.
    assert choose_draft_len(0.8, 0.1) == 6
    assert choose_draft_len(0.5, 0.5) == 1
    assert choose_draft_len(0.9, 0.05) == 8
    assert choose_draft_len(0.9, 0.05, max_k=4) == 4
    assert choose_draft_len(0.6, 0.0, max_k=5) == 5  # a free draft: longest wins
    for alpha, c in itertools.product((0.3, 0.6, 0.95), (0.02, 0.2, 0.6)):
        best = choose_draft_len(alpha, c)
        assert all(
            expected_speedup(alpha, best, c) >= expected_speedup(alpha, k, c) for k in range(1, 9)
        )


def test_measure_acceptance_profiles_a_draft(tiny_llama: Path, shallow_draft: Path) -> None:
    self_profile = measure_acceptance(tiny_llama, tiny_llama, PROMPTS[:2], max_k=3, max_tokens=16)
    assert self_profile.alpha == 1.0 and self_profile.alpha_per_position == [1.0] * 3
    profile = measure_acceptance(tiny_llama, shallow_draft, PROMPTS, max_k=3, max_tokens=24)
    assert 0 < profile.alpha < 1 and len(profile.alpha_per_position) == 3
    assert profile.num_drafts > 0
    assert profile.draft_ms_per_token > 0 and profile.target_ms_per_token > 0
    assert profile.cost_ratio == pytest.approx(
        profile.draft_ms_per_token / profile.target_ms_per_token
    )


def test_artifact_with_a_draft_speculates_by_default(
    tiny_llama: Path, shallow_draft: Path, tmp_path: Path
) -> None:
    entry = SpeculativeRecord(draft="draft", max_draft_len=3)
    with assemble(tmp_path, Manifest(name="tiny", speculative=entry)) as staging:
        shutil.copytree(tiny_llama, staging.dir / MODEL_DIR)
        nested = staging.dir / "draft"
        shutil.copytree(shallow_draft, nested / MODEL_DIR)
        write_manifest(nested, Manifest(name="tiny-draft"))
    assert staging.path is not None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine.from_artifact(staging.path, verify=True)
    assert engine.speculator is not None and engine.speculator.config.num_speculative_tokens == 3
    assert engine.speculator.proposer is not None
    plain = Engine.from_artifact(staging.path, speculative=False)
    assert plain.speculator is None
    assert engine.generate(PROMPTS[:1], params)[0].token_ids == (
        plain.generate(PROMPTS[:1], params)[0].token_ids
    )
    assert engine.stats().spec_decode_num_drafts > 0


def test_manifest_entry_that_does_not_pay_is_off_unless_asked(tmp_path: Path) -> None:
    from kiln.runtime.engine.spec_decode.speculator import from_manifest

    slow = Manifest(
        name="t", speculative=SpeculativeRecord(draft="draft", max_draft_len=2, pays=False)
    )
    assert from_manifest(slow, tmp_path, None) is None
    forced = from_manifest(slow, tmp_path, True)
    assert forced is not None and forced.num_speculative_tokens == 2
    ngram_entry = SpeculativeRecord(method="ngram", max_draft_len=5, max_matching_ngram_size=2)
    ngram = Manifest(name="t", speculative=ngram_entry)
    config = from_manifest(ngram, tmp_path, None)
    assert config is not None and config.method == "ngram" and config.ngram_max == 2


def test_bad_speculative_config_is_named(tiny_llama: Path) -> None:
    with pytest.raises(UsageError, match="num_speculative_tokens=0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(UsageError, match="method='medusa'"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(UsageError, match="needs a draft model"):
        Engine.from_pretrained(tiny_llama, speculative=SpeculativeConfig())
