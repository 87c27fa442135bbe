"""Block pool and prefix cache: reference counts, chained hashes, LRU eviction."""

from __future__ import annotations

import random
from pathlib import Path

from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine.kv_cache import KVCacheManager, hash_block
from kiln.runtime.engine.sequence import Request


def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit a request the way the scheduler does; returns the prefix-hit token count."""
    hits = kv.get_computed_blocks(req)
    cached = len(hits) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - cached, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return cached


def test_block_hash_is_chained_and_salted() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], salt="tenant-a") != first
    assert hash_block(None, [1, 2, 3, 4]) == first


def test_allocation_wastes_only_the_last_partial_block() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = request("a", list(range(9)))
    assert kv.allocate_slots(req, 9)
    assert len(req.block_table) == 3  # 4 + 4 + 1
    req.num_computed_tokens = 9
    assert kv.allocate_slots(req, 3)  # tokens 9..11 fit in the third block
    assert len(req.block_table) == 3
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1)
    assert len(req.block_table) == 4


def test_shared_prefix_is_reused_with_reference_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = request("a", list(range(10)))
    b = request("b", [*range(8), 99, 98, 97])
    assert admit(kv, a) == 0
    assert admit(kv, b) == 8
    assert a.block_table[:2] == b.block_table[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in b.block_table] == [2, 2, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in b.block_table] == [1, 1, 1]


def test_whole_prompt_hit_still_computes_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, request("a", list(range(8))))
    again = request("b", list(range(8)))
    assert len(kv.get_computed_blocks(again)) == 1  # the second block holds the last token


def test_salt_separates_tenants() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    admit(kv, request("a", list(range(9)), salt="x"))
    assert kv.get_computed_blocks(request("b", list(range(9)), salt="y")) == []
    assert len(kv.get_computed_blocks(request("c", list(range(9)), salt="x"))) == 2


def test_freed_blocks_stay_cached_until_evicted_least_recent_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old, new = request("old", list(range(5))), request("new", list(range(100, 105)))
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    assert kv.pool.num_free_blocks == 4
    # Both prefixes are still cached; taking two blocks evicts the older request's first.
    assert len(kv.get_computed_blocks(request("x", list(range(5))))) == 1
    filler = request("filler", list(range(200, 207)))
    assert kv.allocate_slots(filler, 7)
    assert kv.get_computed_blocks(request("y", list(range(5)))) == []
    assert len(kv.get_computed_blocks(request("z", list(range(100, 105))))) == 1


def test_pool_refuses_what_it_does_not_have() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert not kv.allocate_slots(request("a", list(range(9))), 9)
    assert kv.pool.num_free_blocks == 2


def test_random_workload_returns_every_block(tiny_llama: Path) -> None:
    """1,000 random requests, some cancelled mid-flight, on a pool small enough to preempt."""
    rng = random.Random(0)
    engine = Engine.from_pretrained(
        tiny_llama, num_blocks=24, block_size=4, max_num_seqs=16, max_num_batched_tokens=64
    )
    shared = [rng.randrange(1, 500) for _ in range(12)]
    live: list[str] = []
    for i in range(1000):
        prefix = shared[: rng.choice([0, 4, 8, 12])]
        prompt = prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(max_tokens=rng.randrange(1, 16), temperature=0, ignore_eos=True)
        live.append(engine.add_request(prompt, params, request_id=f"r{i}"))
        if rng.random() < 0.5:
            engine.step()
        if rng.random() < 0.2:
            engine.abort(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0
    assert engine.kv.pool.num_free_blocks == 24
    assert all(block.ref_cnt == 0 for block in engine.kv.pool.blocks)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert not engine.requests


def test_trim_frees_rejected_draft_blocks_last_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    req = request("a", list(range(7)))
    assert kv.allocate_slots(req, 7 + 5)  # 7 tokens and 5 draft positions: 3 blocks
    kept, dropped = req.block_table[:2], req.block_table[2:]
    kv.trim(req, 8)  # 8 tokens survive verification: 2 blocks
    assert req.block_table == kept and kv.pool.num_free_blocks == 4
    assert [b.block_id for b in kv.pool.allocate(4)][-1] == dropped[0]
    kv.trim(req, 8)  # nothing more to free
    assert req.block_table == kept
