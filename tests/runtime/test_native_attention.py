"""The native attention kernels against the torch paths they replace on CPU: decode
(runtime/engine/native/csrc/paged_attention.cpp) on random paged caches, every specialised shape and
the generic one; whole prompt chunks (prefill_attention.cpp) on AMX and AVX512-BF16; and
whole-engine greedy decoding with each kernel on and off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kiln.runtime.engine.attention as attention
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine import native
from kiln.runtime.engine.attention import PagedKVCache
from tests.runtime.conftest import needs_amx_kernels, needs_dpbf16_kernels
from tests.runtime.test_batch_invariance import audit_prompts
from tests.tiny_models import make_tiny_model

# Skipped only where the build is impossible; a source that fails to compile fails here.
pytestmark = pytest.mark.skipif(
    native.missing_toolchain() is not None or os.environ.get("KILN_NATIVE") == "0",
    reason=f"native kernels cannot be built here: {native.missing_toolchain()}",
)


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    """Build (or load) the kernels once; a compile error fails every test here."""
    assert native.available()


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    bf16_probabilities: bool = False,
) -> torch.Tensor:
    """Per sequence: gather its blocks, cut to its length, SDPA with grouped heads. With
    `bf16_probabilities`, in float64 with each max-subtracted exp rounded to bf16 before it
    weighs the values (their unrounded sum divides), as kiln's kernel does on bf16 dot
    products."""
    out = []
    for b in range(q.shape[0]):
        keys = k_cache[:, tables[b]].flatten(1, 2)[:, : int(lens[b])]
        values = v_cache[:, tables[b]].flatten(1, 2)[:, : int(lens[b])]
        group = q.shape[1] // k_cache.shape[0]
        if bf16_probabilities:
            keys = keys.double().repeat_interleave(group, 0)
            values = values.double().repeat_interleave(group, 0)
            scores = torch.einsum("hd,htd->ht", q[b].double(), keys) * scale
            exps = torch.exp(scores - scores.amax(dim=1, keepdim=True))
            weighed = torch.einsum("ht,htd->hd", exps.bfloat16().double(), values)
            out.append((weighed / exps.sum(dim=1, keepdim=True)).float())
            continue
        attended = F.scaled_dot_product_attention(
            q[b].unsqueeze(1),
            keys.repeat_interleave(group, 0),
            values.repeat_interleave(group, 0),
            scale=scale,
        )
        out.append(attended.squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("kv_heads", "group", "dim"),
    [(3, 3, 64), (2, 4, 128), (4, 1, 64), (1, 8, 128), (2, 3, 32), (1, 12, 64), (2, 2, 80)],
)
def test_kernel_matches_gather_and_sdpa(kv_heads: int, group: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(kv_heads * 100 + group * 10 + dim)
    block_size, num_blocks, batch, width = 16, 64, 5, 6
    k_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * width].view(batch, width)
    # 1 token, a partial block, exactly full blocks, and the whole table.
    lens = torch.tensor([1, 7, 16, 33, width * block_size])
    q = torch.randn(batch, kv_heads * group, dim, generator=generator)
    scale = dim**-0.5
    got = torch.ops.kiln.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, scale))


@pytest.mark.parametrize("bf16_query", [False, True])
@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (2, 2, 80), (1, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 8, 40])
def test_kernel_reads_a_bfloat16_cache_as_its_float32_values(
    kv_heads: int, group: int, dim: int, bf16_query: bool, block_size: int
) -> None:
    """bf16_query: the queries of a bf16 model, whose scores and weighted values run on bf16
    dot products where the CPU has them (AVX512-BF16). Blocks of 8 and 40 rows: the kernel
    walks (and asks ahead for) runs of 16 rows, a block's last run a partial one."""
    generator = torch.Generator().manual_seed(7)
    shape = (kv_heads, 32, block_size, dim)
    k_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    tables = torch.randperm(32, generator=generator)[:12].view(3, 4)
    lens = torch.tensor([1, 23, 4 * block_size])
    q = torch.randn(3, kv_heads * group, dim, generator=generator)
    if bf16_query:
        q = q.bfloat16().float()
    got = torch.ops.kiln.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    assert got.dtype == torch.float32
    # bf16 queries on a bf16 cache where the CPU has AVX512-BF16 (and dims in pairs of 32):
    # the probabilities are rounded to bf16, as torch's flash kernel rounds them
    rounded = bf16_query and dim % 32 == 0 and native.dpbf16_kernels_available()
    expected = reference(q, k_cache.float(), v_cache.float(), tables, lens, 0.1, rounded)
    torch.testing.assert_close(got, expected)


def test_kernel_accepts_a_non_contiguous_query() -> None:
    k_cache = torch.randn(2, 8, 4, 64)
    v_cache = torch.randn(2, 8, 4, 64)
    tables = torch.tensor([[3, 1], [0, 7]])
    lens = torch.tensor([6, 8])
    qk = torch.randn(2, 6, 64)  # queries and keys side by side, as the model lays them out
    q = qk[:, :4]
    got = torch.ops.kiln.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    expected = reference(q.contiguous(), k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[0, 9]], [20], "bad block id"),
        ([[0, 1]], [33], "context length out of range"),
        ([[0, 1]], [0], "context length out of range"),
    ],
)
def test_kernel_rejects_bad_tables(tables: list[list[int]], lens: list[int], message: str) -> None:
    cache = torch.zeros(1, 4, 16, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kiln.paged_decode_attention(
            torch.zeros(1, 2, 64), cache, cache, torch.tensor(tables), torch.tensor(lens), 1.0
        )


def test_engine_greedy_and_logprobs_same_with_kernel_on_and_off(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 ragged prompts decoded together: identical tokens, log-probabilities to rounding."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    prompts = audit_prompts(tiny_llama)
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(attention, "NATIVE_DECODE", on)
        engine = Engine.from_pretrained(tiny_llama, enable_prefix_caching=False)
        assert engine.runner.native_decode is on
        runs[on] = engine.generate(prompts, params)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert x is not None and y is not None
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_kernel_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_NATIVE", "0")
    assert native._load() is False


def test_a_source_that_does_not_compile_raises_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    broken = tmp_path / "broken_kernel.cpp"
    broken.write_text("int paged_decode_attention( {\n  return 0;\n}\n")  # a planted syntax error
    with pytest.raises(native.NativeBuildError) as caught:
        native.build([broken], "kiln_native_broken_test")
    message = str(caught.value)
    assert str(broken) in message and "failed to build" in message
    assert "error" in message.split("failed to build", 1)[1]  # the compiler's own words
    assert "KILN_NATIVE=0" in message


def test_a_march_gcc_refuses_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(native, "MARCH", "no-such-cpu")
    monkeypatch.setattr(native, "CFLAGS", ["-O1", "-march=no-such-cpu"])
    source = tmp_path / "fine_kernel.cpp"
    source.write_text("int kiln_fine_kernel() { return 0; }\n")
    with pytest.raises(native.NativeBuildError) as caught:
        native.build([source], "kiln_native_march_test")
    message = str(caught.value)
    assert "KILN_NATIVE_MARCH=no-such-cpu" in message and "unset it" in message
    assert "bug in kiln" not in message


def torch_decode_step(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    heads: int,
    scale: float,
) -> torch.Tensor:
    """What the model does without `decode_attention_`: store keys and values in the caches'
    dtype (attention.PagedKVCache.write), attend in the caches' dtype widened to float32, and
    return the model's dtype."""
    kv_heads, _, _, dim = k_cache.shape
    rows = qkv.shape[0]
    parts = qkv.view(rows, heads + 2 * kv_heads, dim)
    q, k, v = parts[:, :heads], parts[:, heads : heads + kv_heads], parts[:, heads + kv_heads :]
    for cache, values in ((k_cache, k), (v_cache, v)):
        flat = cache.view(kv_heads, -1, dim)
        flat.index_copy_(1, slots, values.transpose(0, 1).to(cache.dtype))
    q = q.to(k_cache.dtype).float()
    out = torch.ops.kiln.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    return out.view(rows, heads * dim).to(qkv.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("held", [torch.float32, torch.bfloat16])
def test_fused_decode_step_stores_and_attends_as_the_torch_path(
    dtype: torch.dtype, held: torch.dtype
) -> None:
    """One call per layer for a decode-only step: the same cache contents and the same
    attention output, bit for bit, as the ~10 torch calls it replaces; every new key is
    attended by its own row (it is stored before any row reads)."""
    generator = torch.Generator().manual_seed(11)
    kv_heads, heads, dim, block_size, num_blocks = 3, 9, 64, 16, 24
    caches = [
        torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator).to(held)
        for _ in range(2)
    ]
    tables = torch.randperm(num_blocks, generator=generator)[:12].view(4, 3)
    lens = torch.tensor([1, 17, 32, 48])
    # each row's new token sits at its last position
    slots = torch.stack(
        [
            tables[b, (n - 1) // block_size] * block_size + (n - 1) % block_size
            for b, n in enumerate(lens.tolist())
        ]
    )
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    ours = [c.clone() for c in caches]
    theirs = [c.clone() for c in caches]
    got = torch.ops.kiln.decode_attention_(qkv, *ours, slots, tables, lens, heads, 0.125)
    expected = torch_decode_step(qkv, *theirs, slots, tables, lens, heads, 0.125)
    assert got.dtype == dtype and got.shape == (4, heads * dim)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not torch.equal(ours[0], caches[0])


@pytest.mark.parametrize(
    ("slot", "block", "message"), [(16 * 8, 0, "slot out of range"), (0, 9, "bad block id")]
)
def test_fused_decode_step_refuses_bad_slots_and_tables_before_storing(
    slot: int, block: int, message: str
) -> None:
    k_cache, v_cache = torch.zeros(1, 8, 16, 64), torch.zeros(1, 8, 16, 64)
    qkv = torch.ones(1, 3 * 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kiln.decode_attention_(
            qkv, k_cache, v_cache, torch.tensor([slot]), torch.tensor([[block]]),
            torch.tensor([1]), 1, 1.0,
        )  # fmt: skip
    assert not k_cache.any() and not v_cache.any()


def test_engine_decodes_alike_with_and_without_the_fused_step(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens and log-probabilities identical whether decode-only steps take the one
    native call per layer or the torch calls around the kernel; the fused step is taken."""
    import kiln.runtime.engine.model as model_module

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompts = audit_prompts(tiny_llama)[:6]
    runs = {}
    taken = []
    real = model_module.fused_decode
    for on in (True, False):

        def chosen(*args: object, on: bool = on) -> bool:
            result = on and real(*args)  # type: ignore[arg-type]
            taken.append(result)
            return result

        monkeypatch.setattr(model_module, "fused_decode", chosen)
        engine = Engine.from_pretrained(tiny_llama, enable_prefix_caching=False)
        runs[on] = engine.generate(prompts, params)
    assert any(taken)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x is not None and y is not None
            assert {t: p.logprob for t, p in x.items()} == {t: p.logprob for t, p in y.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_store_writes_the_bytes_index_copy_writes(dtype: torch.dtype) -> None:
    cpu = torch.device("cpu")
    native_cache = PagedKVCache(2, 16, 16, 3, 64, dtype, cpu)
    torch_cache = PagedKVCache(2, 16, 16, 3, 64, dtype, cpu)
    qkv = torch.randn(40, 15 * 64).to(dtype)  # keys and values are views of the projection
    k, v = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64), qkv[:, 12 * 64 :].view(40, 3, 64)
    slots = torch.randperm(16 * 16)[:40]
    native_cache.write(1, k, v, slots)
    for cache, values in ((torch_cache.k, k), (torch_cache.v, v)):
        cache[1].view(3, -1, 64).index_copy_(1, slots, values.transpose(0, 1))
    assert torch.equal(native_cache.k[1], torch_cache.k[1])
    assert torch.equal(native_cache.v[1], torch_cache.v[1])
    assert not native_cache.k[0].any()  # other layers untouched


def test_native_store_refuses_a_slot_past_the_cache_before_storing() -> None:
    cache = PagedKVCache(1, 4, 16, 3, 64, torch.bfloat16, torch.device("cpu"))
    k = torch.randn(2, 3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="kv_store_: slot out of range"):
        torch.ops.kiln.kv_store_(cache.k[0], cache.v[0], k, k, torch.tensor([3, 64]))
    assert not cache.k[0].any()
    with pytest.raises(RuntimeError, match="of the caches' dtype"):
        torch.ops.kiln.kv_store_(cache.k[0], cache.v[0], k.float(), k.float(), torch.tensor([0, 1]))


def qkv_views(tokens: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple:
    """q, k, v as the stacked projection's views: [T, heads, D] rows at the qkv stride."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator) * 2).bfloat16()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return q, k, v


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    tokens, heads, dim = q.shape
    attended = F.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1).reshape(tokens, heads * dim)


# kiln's whole-chunk prefill attention on each unit it runs on (prefill_attention.cpp)
UNITS = [
    pytest.param("amx_prefill_attention", marks=needs_amx_kernels, id="amx"),
    pytest.param("dpbf16_prefill_attention", marks=needs_dpbf16_kernels, id="dpbf16"),
]


@pytest.mark.parametrize("op", UNITS)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"),
    [(128, 9, 3, 64), (1, 9, 3, 64), (37, 4, 4, 64), (200, 8, 2, 128), (33, 6, 3, 64)],
)
def test_prefill_attention_matches_causal_sdpa(
    op: str, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    q, k, v = qkv_views(tokens, heads, kv_heads, dim, seed=tokens)
    got = getattr(torch.ops.kiln, op)(q, k, v, dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, heads * dim)
    exact = causal_sdpa(q.double(), k.double(), v.double(), dim**-0.5)
    flash = causal_sdpa(q, k, v, dim**-0.5)  # torch's bf16 kernel, the path it replaces
    # float32 sums, probabilities rounded to bf16 as torch's flash kernel rounds them, one
    # rounding of the result: within what torch's own bf16 kernel gets
    limit = max(2 * (flash.double() - exact).abs().max().item(), 1e-3)
    assert (got.double() - exact).abs().max().item() <= limit


@pytest.mark.parametrize("op", UNITS)
def test_prefill_attention_gives_a_query_the_same_bits_in_a_longer_chunk(op: str) -> None:
    attend = getattr(torch.ops.kiln, op)
    q, k, v = qkv_views(70, 6, 2, 64, seed=1)
    whole = attend(q, k, v, 0.125)
    for length in (1, 16, 17, 33, 64):
        part = attend(q[:length], k[:length], v[:length], 0.125)
        assert torch.equal(part, whole[:length])


@pytest.mark.parametrize("op", UNITS)
def test_prefill_attention_refuses_what_it_cannot_read(op: str) -> None:
    attend = getattr(torch.ops.kiln, op)
    q, k, v = qkv_views(8, 4, 2, 32, seed=0)
    with pytest.raises(RuntimeError, match=f"{op}: .*head_dim a multiple of 64"):
        attend(q, k, v, 0.125)
    q, k, v = qkv_views(8, 4, 2, 64, seed=0)
    with pytest.raises(RuntimeError, match="bfloat16 on the CPU"):
        attend(q.float(), k.float(), v.float(), 0.125)


@pytest.mark.skipif(
    not (native.amx_kernels_available() or native.dpbf16_kernels_available()),
    reason="kiln's prefill attention needs a CPU with AMX-BF16 or AVX512-BF16",
)
def test_engine_prefill_on_kilns_kernel_gives_torchs_first_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_tiny_model(tmp_path / "tiny", num_heads=2, num_kv_heads=1)  # head_dim 64
    prompts = ["The quick brown fox jumps over the lazy dog " * k for k in (1, 3, 6)]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    q, k, v = qkv_views(4, 2, 1, 64, seed=0)
    assert attention.native_prefill(q, k, v) is not None
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(attention, "NATIVE_PREFILL", on)
        engine = Engine.from_pretrained(model, dtype="bfloat16", enable_prefix_caching=False)
        runs[on] = engine.generate(prompts, params)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        assert first_a is not None and first_b is not None
        for token in set(first_a) & set(first_b):
            assert abs(first_a[token].logprob - first_b[token].logprob) < 0.05
        assert a.token_ids == b.token_ids
