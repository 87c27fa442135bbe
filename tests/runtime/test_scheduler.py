"""Scheduling: token budget, chunked prefill, continuous batching, preemption by recompute."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.runtime import Engine, EngineConfig, SamplingParams
from kiln.runtime.engine.kv_cache import KVCacheManager
from kiln.runtime.engine.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.engine.sequence import Request, RequestStatus
from tests.runtime.conftest import logprobs_of, prompt_ids

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def make_scheduler(num_blocks: int, **config: object) -> Scheduler:
    cfg = EngineConfig(block_size=4, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, KVCacheManager(num_blocks, 4))


def advance(scheduler: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after a forward, without a model: count tokens, sample one."""
    for request, count in zip(out.requests, out.num_new_tokens, strict=True):
        request.num_computed_tokens += count
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(next_token)


def test_token_budget_chunks_long_prompts() -> None:
    scheduler = make_scheduler(64, max_num_batched_tokens=10)
    long, short = Request("long", list(range(25)), GREEDY), Request("short", [1, 2, 3], GREEDY)
    scheduler.add(long)
    scheduler.add(short)
    first = scheduler.schedule()
    assert first.requests == [long] and first.num_new_tokens == [10]
    advance(scheduler, first)
    second = scheduler.schedule()
    assert second.num_new_tokens == [10]  # the long prompt keeps the whole budget
    advance(scheduler, second)
    third = scheduler.schedule()
    assert third.requests == [long, short] and third.num_new_tokens == [5, 3]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(64, max_num_seqs=2)
    for i in range(3):
        scheduler.add(Request(f"r{i}", [1, 2, 3], GREEDY))
    out = scheduler.schedule()
    assert [r.request_id for r in out.requests] == ["r0", "r1"]
    assert len(scheduler.waiting) == 1


def test_newest_running_request_is_preempted_to_the_front_of_the_queue() -> None:
    scheduler = make_scheduler(4)
    old, new = Request("old", [1] * 8, GREEDY), Request("new", [2] * 7, GREEDY)
    scheduler.add(old)
    scheduler.add(new)
    advance(scheduler, scheduler.schedule())  # old: 2 blocks (+1 token), new: 2 blocks
    waiting = Request("later", [3] * 3, GREEDY)
    scheduler.add(waiting)
    out = scheduler.schedule()  # old needs a third block: none free, so `new` makes room
    assert out.preempted == [new]
    assert out.requests == [old]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert not new.block_table
    assert scheduler.waiting.peek() is new


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    scheduler = make_scheduler(4, scheduling_policy="priority", max_num_seqs=1)
    low, high = Request("low", [1] * 3, GREEDY, priority=5), Request("high", [2] * 3, GREEDY)
    scheduler.add(low)
    scheduler.add(high)
    assert scheduler.schedule().requests == [high]


def test_preempted_greedy_output_equals_unpreempted(tiny_llama: Path) -> None:
    prompts = prompt_ids(tiny_llama)
    roomy = Engine.from_pretrained(tiny_llama, block_size=4)
    tight = Engine.from_pretrained(tiny_llama, block_size=4, num_blocks=24)
    expected = roomy.generate(prompts, GREEDY)
    got = tight.generate(prompts, GREEDY)
    assert tight.stats().num_preemptions > 0
    # each output says how often its request was preempted (vLLM's request_num_preemptions)
    assert sum(o.num_preemptions for o in got) == tight.stats().num_preemptions
    assert [o.num_preemptions for o in expected] == [0] * len(prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]


def test_preempted_seeded_sampling_equals_unpreempted(tiny_llama: Path) -> None:
    prompts = prompt_ids(tiny_llama)
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)
    ]
    roomy = Engine.from_pretrained(tiny_llama, block_size=4)
    tight = Engine.from_pretrained(tiny_llama, block_size=4, num_blocks=24)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_preempted_request_resumes_with_chunked_prefill_off(tiny_llama: Path) -> None:
    prompts = prompt_ids(tiny_llama)
    expected = Engine.from_pretrained(tiny_llama).generate(prompts, GREEDY)
    tight = Engine.from_pretrained(
        tiny_llama,
        block_size=4,
        num_blocks=24,
        enable_chunked_prefill=False,
        max_num_batched_tokens=60,  # fits every prompt, not every prompt + its output
    )
    got = tight.generate(prompts, GREEDY)
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_chunked_prefill_equals_unchunked(tiny_llama: Path) -> None:
    prompts = prompt_ids(tiny_llama)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    whole = Engine.from_pretrained(tiny_llama).generate(prompts, params)
    chunked = Engine.from_pretrained(tiny_llama, max_num_batched_tokens=5).generate(prompts, params)
    for a, b in zip(whole, chunked, strict=True):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        prompt = a.prompt_token_ids[1:]
        lp_a = logprobs_of(a.prompt_logprobs[1:], prompt)
        torch.testing.assert_close(
            lp_a, logprobs_of(b.prompt_logprobs[1:], prompt), atol=1e-4, rtol=0
        )


def test_prefix_cache_hit_gives_the_same_output(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, block_size=4)
    prompt = [t for p in prompt_ids(tiny_llama, 2) for t in p]
    first = engine.generate([prompt], GREEDY)[0]
    second = engine.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens >= len(prompt) - 4
    assert second.token_ids == first.token_ids
    assert engine.stats().prefix_cache_hits == second.num_cached_tokens


def test_prompt_logprobs_from_a_start_reuse_the_cached_context(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, block_size=4)
    context = [t for p in prompt_ids(tiny_llama, 2) for t in p]
    endings = [context[1:3], context[4:7]]
    whole = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    expected = [
        Engine.from_pretrained(tiny_llama).generate([context + e], whole)[0] for e in endings
    ]
    start = len(context)
    tail = SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=start
    )
    first = engine.generate([context + endings[0]], tail)[0]
    second = engine.generate([context + endings[1]], tail)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= start - 4  # the context came from the prefix cache
    for out, ref, ending in zip((first, second), expected, endings, strict=True):
        assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
        assert out.prompt_logprobs[:start] == [None] * start
        torch.testing.assert_close(
            logprobs_of(out.prompt_logprobs[start:], ending),
            logprobs_of(ref.prompt_logprobs[start:], ending),
            atol=1e-4,
            rtol=0,
        )


def test_requests_join_a_running_batch(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    prompts = prompt_ids(tiny_llama, 2)
    alone = Engine.from_pretrained(tiny_llama).generate([prompts[1]], GREEDY)[0]
    first = engine.add_request(prompts[0], GREEDY)
    for _ in range(5):
        engine.step()
    second = engine.add_request(prompts[1], GREEDY)
    produced: dict[str, list[int]] = {first: [], second: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] += out.token_ids
    assert len(produced[first]) == 15
    assert produced[second] == alone.token_ids


def test_draft_tokens_are_scheduled_when_budget_and_blocks_allow() -> None:
    scheduler = make_scheduler(3, max_num_batched_tokens=4)
    request = Request("r", [1, 2, 3], GREEDY)
    scheduler.add(request)
    advance(scheduler, scheduler.schedule())  # prefill: 3 computed, 4 tokens, 1 block
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    assert out.num_new_tokens == [4]  # the last token and three drafts, in one chunk
    assert len(request.block_table) == 2  # positions 3..6 reach into a second block
    scheduler.kv.trim(request, request.num_computed_tokens + 1)  # all drafts rejected
    request.num_computed_tokens += 1
    request.drop_spec()
    request.append_token(7)
    request.spec_token_ids = [8, 9, 10, 11]  # 5 tokens: more than the budget of 4
    out = scheduler.schedule()
    assert out.num_new_tokens == [1] and request.spec_token_ids == []


def test_a_long_prefill_shares_each_step_with_new_and_decoding_requests() -> None:
    scheduler = make_scheduler(64, max_num_batched_tokens=10, long_prefill_token_threshold=4)
    long, short = Request("long", list(range(25)), GREEDY), Request("short", [1, 2, 3], GREEDY)
    scheduler.add(long)
    first = scheduler.schedule()
    assert first.requests == [long] and first.num_new_tokens == [4]
    advance(scheduler, first)
    scheduler.add(short)
    second = scheduler.schedule()  # the short prompt goes in whole beside the long's chunk
    assert second.requests == [long, short] and second.num_new_tokens == [4, 3]
    advance(scheduler, second)
    assert short.num_output_tokens == 1 and long.num_computed_tokens == 8
    while long.num_computed_tokens < long.num_prompt_tokens:
        step = scheduler.schedule()
        assert dict(zip(step.requests, step.num_new_tokens, strict=True)) == {
            long: min(4, long.num_prompt_tokens - long.num_computed_tokens),
            short: 1,  # a decode in every step of the long prefill
        }
        advance(scheduler, step)
    assert short.num_output_tokens == 6 and long.num_output_tokens == 1


def test_without_chunked_prefill_the_threshold_leaves_prompts_whole() -> None:
    scheduler = make_scheduler(
        64, max_num_batched_tokens=30, long_prefill_token_threshold=4, enable_chunked_prefill=False
    )
    long = Request("long", list(range(25)), GREEDY)
    scheduler.add(long)
    assert scheduler.schedule().num_new_tokens == [25]


def test_a_long_prompt_does_not_hold_a_short_request_until_its_prefill_ends(
    tiny_llama: Path,
) -> None:
    engine = Engine.from_pretrained(
        tiny_llama, max_num_batched_tokens=32, long_prefill_token_threshold=8
    )
    long = engine.add_request(list(range(3, 103)), GREEDY)  # 100 prompt tokens
    engine.step()
    short = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    finished: list[str] = []
    while engine.has_unfinished_requests() and short not in finished:
        finished += [out.request_id for out in engine.step() if out.finished]
    assert short in finished
    assert engine.requests[long].num_computed_tokens < 100  # still in its prefill
