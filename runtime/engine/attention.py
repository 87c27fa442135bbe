"""Paged attention over the KV-cache tensors: torch ops, plus one native CPU kernel.

Layout: each layer's K and V cache is [num_kv_heads, num_blocks, block_size, head_dim], so
gathering a batch's blocks (as rows of block_size * head_dim values, `index_select` on dim 0)
yields [kv_heads, batch, context, head_dim] with no copy beyond the gather itself, and
grouped-query heads fold into the query length of `scaled_dot_product_attention` (queries
[kv_heads, batch, group, head_dim]). On this CPU that is 6x faster than gathering in
token-major layout and permuting.

A step's tokens are laid out decodes first (one token per sequence, attended as one batch),
then each prefill chunk (attended one sequence at a time with a causal mask aligned to the
end of its context, which covers chunked prefill and prefix-cache hits). With a float32
cache on CPU the decode rows skip the gather: the native kernel (`native_decode`) reads each
sequence's keys and values straight from its blocks. A step of decodes only (the steady state
of serving) goes further (`fused_decode`): one native call per layer stores the step's keys
and values and attends, reading the stacked qkv projection as it is and returning the
model's dtype, where the torch path around the kernel makes ~10 operator calls per layer
(W4A16 SmolLM2-135M, one stream, one thread, a 2-core Zen 3 EPYC: 17.9 -> 16.0 ms per token;
its bf16 checkpoint 34.4 -> 30.0 ms).

Sliding-window layers (Mistral, Gemma 3) attend through `AttentionMetadata.windowed`: the same
rows with masks that also hide the keys behind each query's window, on the torch path. The
cache holds every layer's whole context (the windows are masked, not evicted).

The KV cache may hold FP8 or INT8 codes with per-tensor (or per-head) scales from the
checkpoint: values are quantised on write and dequantised on read, so attention always sees
exactly what the cache holds, as on the serving GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native

FP8_MAX = 448.0
# Tests turn this off to run the pure-torch decode path on a machine that has the kernel.
NATIVE_DECODE = True
# Whole-context prefill chunks on kiln's kernel where it serves (False: torch's SDPA).
NATIVE_PREFILL = True


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's prefill chunk: rows [start, start + length) of the step's tokens."""

    start: int
    length: int
    context_len: int
    block_ids: torch.Tensor
    # Additive mask [length, context_len]; None when the chunk is the whole context (causal).
    bias: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each of them attends to."""

    slot_mapping: torch.Tensor
    num_decodes: int = 0
    # Each decode row's blocks, padded to the longest row: [num_decodes * blocks_per_row].
    decode_block_ids: torch.Tensor | None = None
    # Each decode row's context length (its new token included): [num_decodes] int64.
    decode_lens: torch.Tensor | None = None
    # Decode rows attend with the native kernel (see `native_decode`), else the torch path.
    native_decode: bool = False
    # Additive mask [1, num_decodes, 1, blocks_per_row * block_size] hiding the padding
    # (the torch path only).
    decode_bias: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # What the sliding-window layers attend with (the same rows, masks that also hide what
    # lies behind the window), where some row's context exceeds the window; None: every
    # context fits it and these masks serve them too.
    windowed: AttentionMetadata | None = None


class PagedKVCache:
    """Every layer's K and V blocks, with optional FP8/INT8 storage and per-layer scales."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        quant: str | None = None,
        k_scales: list[torch.Tensor] | None = None,
        v_scales: list[torch.Tensor] | None = None,
    ) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Attention runs in `dtype`: the storage dtype, or the model's for FP8/INT8 codes.
        self.dtype = dtype
        self.quant = quant
        storage = {None: dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[quant]
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        # Zeros, not empty: padding slots are masked, but 0 * NaN garbage would still poison V.
        self.k = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=storage, device=device) for _ in range(num_layers)]
        self.head_offsets = torch.arange(num_kv_heads, device=device).unsqueeze(1) * num_blocks
        self.k_scales = [_head_scale(s, device) for s in k_scales or []]
        self.v_scales = [_head_scale(s, device) for s in v_scales or []]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store K and V [tokens, kv_heads, head_dim] at flat slot ids (block * size + offset)."""
        if self.quant is None and self._native_store(k, v):
            torch.ops.kiln.kv_store_(self.k[layer], self.v[layer], k, v, slots)
            return
        flat = (self.num_kv_heads, -1, self.head_dim)
        for cache, values, scales in ((self.k, k, self.k_scales), (self.v, v, self.v_scales)):
            values = values.transpose(0, 1)
            target = cache[layer]
            if self.quant is not None:
                values = self._encode(values, scales[layer])
            elif values.dtype != self.dtype:
                values = values.to(self.dtype)
            if self.quant == "fp8":  # index_copy_ has no float8 kernel; bytes are bytes
                target, values = target.view(torch.uint8), values.view(torch.uint8)
            target.view(flat).index_copy_(1, slots, values)

    def _native_store(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `write` copies rows with the native kernel (the same bytes as index_copy_):
        float32 or bf16 values of the cache's dtype, on the CPU."""
        return (
            k.device.type == "cpu"
            and k.dtype == v.dtype == self.dtype
            and self.dtype in (torch.float32, torch.bfloat16)
            and k.stride(-1) == 1
            and v.stride(-1) == 1
            and native.available()
        )

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, in order: [kv_heads, len(block_ids) * block_size, dim]."""
        # Each (head, block) is one contiguous row of block_size * head_dim values; selecting
        # rows along dim 0 is a plain row copy, twice as fast here as index_select on dim 1.
        rows = (self.head_offsets + block_ids).view(-1)
        out = []
        for cache, scales in ((self.k, self.k_scales), (self.v, self.v_scales)):
            blocks = cache[layer].view(-1, self.block_size * self.head_dim).index_select(0, rows)
            values = blocks.view(self.num_kv_heads, -1, self.head_dim)
            if self.quant is not None:
                values = (values.to(torch.float32) * scales[layer]).to(self.dtype)
            out.append(values)
        return out[0], out[1]

    def _encode(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = values.to(torch.float32) / scale
        if self.quant == "fp8":
            return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return scaled.round_().clamp_(-128, 127).to(torch.int8)


def _head_scale(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-tensor scale as a scalar, a per-head one as [kv_heads, 1, 1] for broadcasting."""
    scale = scale.to(device=device, dtype=torch.float32)
    return scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1, 1)


def native_decode(cache: PagedKVCache) -> bool:
    """Whether decode rows attend with the native kernel
    (runtime/engine/native/csrc/paged_attention.cpp): a float32 or bfloat16 cache on CPU, where it
    reads each key and value once instead of gathering the context into a new tensor and reading it
    again (decode at batch 32, context 256, this 2-core CPU: 1.3 vs 3.4 ms per layer in isolation);
    it scores and weighs in float32 whatever the cache holds, on bf16 dot products for a bf16 model
    where the CPU has AVX512-BF16 (the probabilities then rounded to bf16, as torch's flash kernel
    rounds them). Every other cache uses the torch path below."""
    return (
        NATIVE_DECODE
        and cache.quant is None
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.k[0].device.type == "cpu"
        and native.available()
    )


def native_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[..., Any] | None:
    """kiln's kernel for a prefill chunk that is its sequence's whole context
    (runtime/engine/native/csrc/prefill_attention.cpp), where it serves: bf16, head_dim a multiple
    of 64, heads and dims contiguous (the qkv projection's views), on a CPU with AMX (its tiles) or
    with AVX512-BF16 (its dot products). SmolLM2-135M's 128-token chunk, one thread, against torch's
    flash kernel: a 2-core Xeon with AMX 95 vs 187 us per layer, a 2-core Zen 4 EPYC 214 vs 649 us.
    Elsewhere, and for chunks that continue a cached context, torch's SDPA."""
    if not (
        NATIVE_PREFILL
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and q.shape[-1] % 64 == 0
        and all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (q, k, v))
    ):
        return None
    if native.amx_kernels_available():
        return torch.ops.kiln.amx_prefill_attention
    if native.dpbf16_kernels_available():
        return torch.ops.kiln.dpbf16_prefill_attention
    return None


def fused_decode(meta: AttentionMetadata, rows: int, dtype: torch.dtype) -> bool:
    """Whether this step's attention runs as one native call per layer (`decode_attention`):
    all `rows` decodes on the native kernel, and qkv in a `dtype` the call reads."""
    return (
        meta.native_decode
        and not meta.prefills
        and meta.num_decodes == rows
        and dtype in (torch.float32, torch.bfloat16)
    )


def decode_attention(
    layer: int,
    qkv: torch.Tensor,
    heads: int,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """A decode-only step's attention in one native call (where `fused_decode`): qkv [T,
    (heads + 2 kv_heads) * dim] (queries and keys rotated) stores its keys and values and
    attends; [T, heads * dim] in qkv's dtype, the values `paged_attention` computes."""
    assert meta.decode_block_ids is not None and meta.decode_lens is not None
    return torch.ops.kiln.decode_attention_(
        qkv,
        cache.k[layer],
        cache.v[layer],
        meta.slot_mapping,
        meta.decode_block_ids.view(meta.num_decodes, -1),
        meta.decode_lens,
        heads,
        scale,
    )


def paged_attention(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; q [T, heads, dim] -> [T, heads * dim]."""
    cache.write(layer, k, v, meta.slot_mapping)
    tokens, heads, dim = q.shape
    kv_heads = cache.num_kv_heads
    group = heads // kv_heads
    if q.dtype != cache.dtype:  # a bf16 cache under an fp32 model: attend as it is held
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)
    decoded = None
    if meta.num_decodes and meta.native_decode:
        assert meta.decode_block_ids is not None and meta.decode_lens is not None
        batch = meta.num_decodes
        decoded = torch.ops.kiln.paged_decode_attention(
            q[:batch].float(),  # scores and softmax in float32 whatever the cache holds
            cache.k[layer],
            cache.v[layer],
            meta.decode_block_ids.view(batch, -1),
            meta.decode_lens,
            scale,
        ).view(batch, heads * dim)
        if not meta.prefills:
            return decoded
    elif meta.num_decodes:
        assert meta.decode_block_ids is not None
        batch = meta.num_decodes
        keys, values = cache.gather(layer, meta.decode_block_ids)
        query = q[:batch].view(batch, kv_heads, group, dim).transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            query,
            keys.view(kv_heads, batch, -1, dim),
            values.view(kv_heads, batch, -1, dim),
            attn_mask=meta.decode_bias,
            scale=scale,
        )
        decoded = attended.transpose(0, 1).reshape(batch, heads * dim)
        if not meta.prefills:
            return decoded
    out = torch.empty_like(q)
    if decoded is not None:
        out[: meta.num_decodes] = decoded.view(-1, heads, dim)
    whole_context = native_prefill(q, k, v)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.bias is None and cache.quant is None and whole_context is not None:
            attended = whole_context(q[rows], k[rows], v[rows], scale)
            out[rows] = attended.view(chunk.length, heads, dim)
            continue
        if chunk.bias is None and cache.quant is None:
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            keys, values = cache.gather(layer, chunk.block_ids)
            keys, values = keys[:, : chunk.context_len], values[:, : chunk.context_len]
        # A batch dimension of one: 4-d inputs reach torch's fused (flash) CPU kernel, 3-d
        # ones its unfused math path (SmolLM2-135M, a 128-token chunk, bf16, one thread: 0.25
        # vs 1.04 ms per layer).
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=chunk.bias,
            is_causal=chunk.bias is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[rows] = attended[0].transpose(0, 1)
    return out.view(tokens, heads * dim)
