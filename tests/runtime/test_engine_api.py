"""The engine's public API: generate, artifacts, abort, stats, async streaming, and one
request answered alone."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kiln.runtime import AsyncEngine, Engine, SamplingParams
from kiln.runtime.base.errors import ArtifactError, UsageError
from kiln.runtime.engine.answer import answer_alone
from kiln.runtime.engine.chat import chat_token_ids
from kiln.runtime.formats.artifact import MODEL_DIR, Manifest, assemble
from tests.runtime.conftest import PROMPTS, prompt_ids

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_generate_takes_text_and_per_prompt_params(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5)]
    outputs = engine.generate(PROMPTS[:2], params)
    assert [len(o.token_ids) for o in outputs] == [3, 5]
    assert outputs[0].prompt_token_ids == engine.tokenizer.encode(PROMPTS[0])
    for out in outputs:
        assert out.text == engine.tokenizer.decode(out.token_ids)
    with pytest.raises(UsageError, match="2 prompts but 3 sampling params"):
        engine.generate(PROMPTS[:2], [*params, params[0]])


def tiny_artifact(tiny_llama: Path, root: Path) -> Path:
    """An artifact holding only the tiny model."""
    with assemble(root, Manifest(name="tiny")) as staging:
        shutil.copytree(tiny_llama, staging.dir / MODEL_DIR)
    assert staging.path is not None
    return staging.path


def test_from_artifact_loads_the_model_directory(tiny_llama: Path, tmp_path: Path) -> None:
    path = tiny_artifact(tiny_llama, tmp_path)
    from_artifact = Engine.from_artifact(path, verify=True).generate(PROMPTS[:1], GREEDY)[0]
    direct = Engine.from_pretrained(tiny_llama).generate(PROMPTS[:1], GREEDY)[0]
    assert from_artifact.token_ids == direct.token_ids
    with pytest.raises(ArtifactError, match="not a kiln artifact"):
        Engine.from_artifact(tiny_llama)
    (path / MODEL_DIR / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="does not verify"):
        Engine.from_artifact(path, verify=True)


def test_load_takes_an_artifact_or_a_checkpoint_directory(tiny_llama: Path, tmp_path: Path) -> None:
    artifact = Engine.load(tiny_artifact(tiny_llama, tmp_path), verify=True).generate(
        PROMPTS[:1], GREEDY
    )[0]
    checkpoint = Engine.load(tiny_llama).generate(PROMPTS[:1], GREEDY)[0]
    assert artifact.token_ids == checkpoint.token_ids
    with pytest.raises(UsageError, match=r"not a kiln artifact .* not a Hugging Face checkpoint"):
        Engine.load(tmp_path / "nothing")
    with pytest.raises(UsageError, match="verify needs a kiln artifact"):
        Engine.load(tiny_llama, verify=True)


def test_unknown_engine_option_is_named(tiny_llama: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown engine option\(s\) blok_size"):
        Engine.from_pretrained(tiny_llama, blok_size=8)


def test_abort_frees_blocks_at_once(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, block_size=4)
    rid = engine.add_request(prompt_ids(tiny_llama, 1)[0], GREEDY)
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    assert engine.abort(rid)
    assert engine.stats().kv_cache_usage == 0
    assert not engine.has_unfinished_requests()
    assert not engine.abort(rid)


def test_stats_count_requests_and_tokens(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, max_num_seqs=2)
    prompts = prompt_ids(tiny_llama, 3)
    for prompt in prompts:
        engine.add_request(prompt, GREEDY)
    engine.step()
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (2, 1)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.generation_tokens_total == 3 * GREEDY.max_tokens
    assert stats.prompt_tokens_total == sum(len(p) for p in prompts)
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.generation_throughput > 0 and stats.num_steps > 0


def test_reset_prefix_cache_computes_the_next_prompt_in_full(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama, block_size=4)
    prompt = prompt_ids(tiny_llama, 1)[0] * 3  # several whole blocks
    engine.generate([prompt], GREEDY)
    engine.generate([prompt], GREEDY)
    cached = engine.stats().prefix_cache_hits
    assert cached > 0  # the repeat was served from the cache

    engine.reset_prefix_cache()
    engine.generate([prompt], GREEDY)
    assert engine.stats().prefix_cache_hits == cached

    engine.add_request(prompt, GREEDY)
    with pytest.raises(UsageError, match="still running"):
        engine.reset_prefix_cache()


def test_step_returns_deltas_that_add_up(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    expected = engine.generate(PROMPTS[:2], GREEDY)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    text = {rid: "" for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            text[delta.request_id] += delta.text
            tokens[delta.request_id] += delta.token_ids
    assert [tokens[r] for r in ids] == [o.token_ids for o in expected]
    assert [text[r] for r in ids] == [o.text for o in expected]


def test_async_streams_match_generate_and_abort_frees_blocks(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    expected = engine.generate(PROMPTS[:3], GREEDY)
    server = AsyncEngine(engine)

    async def collect(prompt: str, rid: str) -> tuple[str, list[int], str | None]:
        text, tokens, reason = "", list[int](), None
        async for delta in server.generate(prompt, GREEDY, request_id=rid):
            text += delta.text
            tokens += delta.token_ids
            reason = delta.finish_reason
        return text, tokens, reason

    async def abandon(prompt: str) -> int:
        seen = 0
        async for delta in server.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True)):
            seen += len(delta.token_ids)
            if seen >= 3:
                break  # leaving the stream aborts the request
        return seen

    async def main() -> tuple[list[tuple[str, list[int], str | None]], int]:
        streams = [collect(p, f"s{i}") for i, p in enumerate(PROMPTS[:3])]
        *finished, abandoned = await asyncio.gather(*streams, abandon(PROMPTS[3]))
        return finished, abandoned  # type: ignore[return-value]

    try:
        finished, abandoned = asyncio.run(main())
        assert abandoned >= 3
        for (text, tokens, reason), out in zip(finished, expected, strict=True):
            assert (text, tokens, reason) == (out.text, out.token_ids, "length")
        deadline = time.monotonic() + 5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0
    finally:
        server.shutdown()


def test_async_wakes_each_event_loop_once_a_step(tiny_llama: Path) -> None:
    """A step's deltas reach their streams through one call into the caller's event loop,
    not one each: the engine thread and the loop would otherwise trade the core per request."""
    engine = Engine.from_pretrained(tiny_llama)
    expected = engine.generate(PROMPTS[:4], GREEDY)
    server = AsyncEngine(engine)
    wakes = [0]

    async def collect(prompt: str) -> list[int]:
        return [t async for d in server.generate(prompt, GREEDY) for t in d.token_ids]

    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            wakes[0] += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        return list(await asyncio.gather(*(collect(p) for p in PROMPTS[:4])))

    try:
        steps = engine.stats().num_steps
        tokens = asyncio.run(main())
        steps = engine.stats().num_steps - steps
        assert tokens == [out.token_ids for out in expected]
        assert 0 < wakes[0] <= steps  # 4 streams x 16 tokens: 64 deltas
    finally:
        server.shutdown()


def test_async_serves_callers_on_several_event_loops(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    expected = engine.generate(PROMPTS[:4], GREEDY)
    server = AsyncEngine(engine)

    async def collect(i: int) -> list[int]:
        return [t async for d in server.generate(PROMPTS[i], GREEDY) for t in d.token_ids]

    async def two(i: int) -> list[list[int]]:
        return list(await asyncio.gather(collect(i), collect(i + 1)))

    start = threading.Barrier(2)  # both loops submit at once: each calls start()

    def serve(i: int) -> list[list[int]]:
        start.wait()
        return asyncio.run(two(i))

    try:
        with ThreadPoolExecutor(2) as pool:
            got = [out for part in pool.map(serve, (0, 2), timeout=120) for out in part]
        assert got == [out.token_ids for out in expected]
    finally:
        server.shutdown()


def test_async_start_from_several_threads_runs_one_step_loop(tiny_llama: Path) -> None:
    """Two step loops on one engine would corrupt it: racing callers start exactly one."""

    def step_loops() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kiln-engine"}

    before = step_loops()  # another test's server, left running in this worker
    for _ in range(20):
        server = AsyncEngine(Engine.from_pretrained(tiny_llama))
        barrier = threading.Barrier(4)

        def start(server: AsyncEngine = server, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            server.start()

        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda _: start(), range(4)))
            assert len(step_loops() - before) == 1
        finally:
            server.shutdown()
        assert not step_loops() - before


def test_async_failed_step_fails_every_stream_and_frees_blocks(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    server = AsyncEngine(engine)
    real_run = engine.runner.run
    calls = [0]

    def failing(scheduled: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("kernel failed")
        return real_run(scheduled)

    engine.runner.run = failing  # type: ignore[method-assign,assignment]

    async def collect(prompt: str) -> BaseException | None:
        try:
            async for _ in server.generate(prompt, GREEDY):
                pass
        except RuntimeError as exc:
            return exc
        return None

    async def main() -> list[BaseException | None]:
        return list(await asyncio.gather(*(collect(p) for p in PROMPTS[:3])))

    try:
        errors = asyncio.run(main())
        assert [str(e) for e in errors] == ["kernel failed"] * 3
        assert not engine.has_unfinished_requests()
        assert engine.stats().kv_cache_usage == 0
    finally:
        server.shutdown()


def test_async_rejects_bad_requests_before_queueing(tiny_llama: Path) -> None:
    server = AsyncEngine(Engine.from_pretrained(tiny_llama))

    async def main() -> None:
        async for _ in server.generate([]):
            pass

    with pytest.raises(UsageError, match="prompt is empty"):
        asyncio.run(main())
    server.shutdown()


def test_answer_alone_is_generate_with_timings(tiny_llama: Path) -> None:
    engine = Engine.from_pretrained(tiny_llama)
    expected = engine.generate(PROMPTS[:1], GREEDY)[0]
    answer = answer_alone(engine, GREEDY, PROMPTS[0])
    assert (answer.text, answer.token_ids) == (expected.text, expected.token_ids)
    assert answer.finish_reason == "length" and answer.error is None
    assert answer.ttft_s is not None and answer.tpot_s is not None and answer.tpot_s > 0
    chat = [{"role": "user", "content": "hi"}]
    rendered = chat_token_ids(engine.tokenizer, chat)
    by_chat = answer_alone(engine, GREEDY, messages=chat)
    assert by_chat.token_ids == answer_alone(engine, GREEDY, rendered).token_ids
    refused = answer_alone(engine, GREEDY, [])
    assert refused.error is not None and refused.error.startswith("bad request: ")
    assert "prompt is empty" in refused.error and not engine.has_unfinished_requests()
