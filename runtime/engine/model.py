"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, SmolLM2) and its
mixture-of-experts variants (Mixtral, Qwen3-MoE) over a paged KV cache.

Gemma 3 differs in place, not in structure: its norms' (1 + weight) is folded into the weights
at load, its embedding output is scaled by sqrt(hidden_size), attention output and the MLP's
input and output get their own norms (`DecoderLayer.pre_mlp_norm`/`post_mlp_norm`), its MLP
gates with tanh-approximated GELU, and its sliding-window layers rotate with their own base and
attend through the step's windowed metadata (`AttentionMetadata.windowed`).

Plain tensors and functions rather than nn.Modules: the engine only runs inference, and the
forward reads top to bottom like the architecture. q/k/v and gate/up projections are stacked
into one matmul each when their encodings allow. Logits are computed only for the rows the
engine asks for (each sequence's last token, plus prompt rows when prompt log-probabilities
are wanted), which skips the vocabulary projection for most prefill tokens.

On CPU, where the native kernels load (native.py), the elementwise steps run fused: the
residual add with the next RMSNorm, silu(gate) * up, and the rotary embedding of the
queries and keys (in place, tables picked by position, over each head's first rotary_dim
channels: all of them but under Phi-4-mini's partial rotary), each one pass
(runtime/engine/native/csrc/elementwise.cpp; same roundings as torch's operators). SmolLM2-135M's
2048- token prefill, bf16, one thread: RMSNorm 0.56 vs 2.0 ms, add + RMSNorm 0.8 vs 2.6 ms, silu *
up 1.6 vs 3.9 ms, rotary 0.9 vs 2.6 ms per layer; at one token each is one operator call instead of
two to eight. A step of decodes only then attends in one call per layer straight from the rotated
qkv (attention.decode_attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.attention import (
    AttentionMetadata,
    PagedKVCache,
    decode_attention,
    fused_decode,
    paged_attention,
)
from kiln.runtime.engine.layers.greedy_head import GreedyHead
from kiln.runtime.engine.layers.linear import Linear
from kiln.runtime.engine.sampling import greedy_tokens
from kiln.runtime.formats.model_info import ModelInfo


def rope_inv_freq(config: ModelInfo, local: bool = False, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies, with linear, Llama-3 or LongRoPE scaling applied (`long`:
    LongRoPE's long factors, else its short ones); with `local`, those of the sliding-window
    layers of a family that rotates them with their own base, unscaled. One per pair of the
    rotary_dim channels RoPE rotates (Phi-4-mini: 96 of each head's 128)."""
    dim = config.rotary_dim
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if config.rope_type == "longrope":  # Phi-3 128k, Phi-3.5, Phi-4-mini
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    factor = float(scaling["factor"])
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        return inv_freq / factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def longrope_limits(config: ModelInfo) -> tuple[int, float] | None:
    """(original_max_position_embeddings, attention factor) of a LongRoPE model, else None:
    the factor as given, else sqrt(1 + ln(factor) / ln(original)) with factor the ratio of
    max_position_embeddings to it (transformers' _compute_longrope_parameters)."""
    scaling = config.rope_scaling
    if config.rope_type != "longrope" or scaling is None:
        return None
    original = int(
        scaling.get("original_max_position_embeddings")
        or config.config.get("original_max_position_embeddings")
        or config.max_position_embeddings
    )
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return original, float(attention)


def long_rope_rows(
    positions: torch.Tensor, meta: AttentionMetadata, original: int, offset: int
) -> torch.Tensor:
    """Each token's row in the stacked LongRoPE table: its position, plus `offset` (the long
    half) where its sequence's context in this step exceeds `original` tokens."""
    long = torch.zeros_like(positions, dtype=torch.bool)
    if meta.num_decodes and meta.decode_lens is not None:
        long[: meta.num_decodes] = meta.decode_lens.to(positions.device) > original
    for chunk in meta.prefills:
        if chunk.context_len > original:
            long[chunk.start : chunk.start + chunk.length] = True
    return positions + long.to(positions.dtype) * offset


@dataclass(slots=True)
class Experts:
    """A sparse MLP block: a float router [experts, hidden] and each expert's stacked gate/up
    and down projections; each token runs its `top_k` experts by router softmax, weighted
    (renormalised over the k where `normalize`), as transformers' Mixtral and Qwen3-MoE do."""

    router: torch.Tensor
    gate_up: list[Linear]
    down: list[Linear]
    top_k: int
    normalize: bool

    def __call__(
        self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        probs = F.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, slot = torch.where(chosen == expert)
            picked = x.index_select(0, rows)
            y = self.down[expert](silu_mul(self.gate_up[expert](picked)))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # None in a sparse layer (its experts hold the MLP)
    down: Linear | None
    # Qwen3: RMSNorm weights [head_dim] applied to each query and key head before RoPE.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    experts: Experts | None = None
    # Gemma 3: the norms of the MLP's input and output (then post_norm is the attention
    # output's norm), and whether the layer attends within the sliding window.
    pre_mlp_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    windowed: bool = False

    def mlp(
        self, x: torch.Tensor, silu_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if self.experts is not None:
            return self.experts(x, silu_mul)
        assert self.gate_up is not None and self.down is not None
        return self.down(silu_mul(self.gate_up(x)))


class CausalLM:
    """Embedding, decoder layers, final norm and LM head, run over a paged KV cache."""

    def __init__(
        self,
        config: ModelInfo,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: Linear,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        # Greedy steps on a bf16 head on kiln's CPU kernel read an int8 screen of it first.
        self.greedy_head = GreedyHead.build(lm_head)
        self.dtype = embed.dtype
        self.dtype_reason = "the weights' dtype"  # the loader says why it chose this dtype
        self.device = embed.device
        self.cos, self.sin = self._rope_tables(rope_inv_freq(config), max_model_len)
        # LongRoPE: a second table with the long factors after the short one; a sequence
        # whose context passes original_max_position_embeddings rotates this step's tokens
        # with it (transformers' rule for one sequence), both scaled by its attention factor.
        # (original_max_position_embeddings, the long table's first row), or None.
        self.long_rope: tuple[int, int] | None = None
        limits = longrope_limits(config)
        if limits is not None:
            original, attention = limits
            long_cos, long_sin = self._rope_tables(rope_inv_freq(config, long=True), max_model_len)
            self.cos = torch.cat((self.cos, long_cos)).mul_(attention)
            self.sin = torch.cat((self.sin, long_sin)).mul_(attention)
            self.long_rope = (original, max_model_len)
        # The sliding layers' own tables (Gemma 3); the global ones where they share them.
        self.local_cos, self.local_sin = (
            self._rope_tables(rope_inv_freq(config, local=True), max_model_len)
            if config.local_rope_theta
            else (self.cos, self.sin)
        )
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # Gemma 3 scales the embedding output by sqrt(hidden_size), rounded to the weights' dtype.
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype) if config.gemma else None
        )
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.fused = (
            self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == self.dtype for t in self._norms())
            and native.available()
        )

    def _rope_tables(
        self, inv_freq: torch.Tensor, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for x * cos + rotate_half(x) * sin with rotate_half's sign folded into sin."""
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        cos = torch.cat((freqs.cos(), freqs.cos()), -1)
        sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
        return (cos.to(device=self.device, dtype=self.dtype),
                sin.to(device=self.device, dtype=self.dtype))  # fmt: skip

    def _norms(self) -> list[torch.Tensor]:
        per_layer = ("input_norm", "post_norm", "q_norm", "k_norm", "pre_mlp_norm", "post_mlp_norm")
        held = (getattr(layer, n) for layer in self.layers for n in per_layer)
        return [self.norm, *(w for w in held if w is not None)]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.kiln.rms_norm(x.contiguous(), weight, self.config.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, its RMSNorm); the fused kernel adds into `residual` in place."""
        if self.fused:
            normed = torch.ops.kiln.add_rms_norm_(residual, delta, weight, self.config.rms_norm_eps)
            return residual, normed
        residual = residual + delta
        return residual, self._rms_norm(residual, weight)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the stacked [gate | up] projection: silu, or Gemma's tanh GELU."""
        if self.gelu:
            half = gate_up.shape[-1] // 2
            return F.gelu(gate_up[:, :half], approximate="tanh").mul_(gate_up[:, half:])
        if self.fused:
            return torch.ops.kiln.silu_mul(gate_up.contiguous())
        half = gate_up.shape[-1] // 2
        return F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])

    def _norm_heads(self, qkv: torch.Tensor, layer: DecoderLayer) -> None:
        """Qwen3's per-head RMSNorm of the queries and keys, written back into qkv (before
        the rotary embedding, as transformers applies it)."""
        c = self.config
        for first, count, weight in ((0, c.num_heads, layer.q_norm),
                                     (c.num_heads, c.num_kv_heads, layer.k_norm)):  # fmt: skip
            assert weight is not None
            cols = slice(first * c.head_dim, (first + count) * c.head_dim)
            heads = qkv[:, cols].reshape(-1, c.head_dim)
            qkv[:, cols] = self._rms_norm(heads, weight).view(qkv.shape[0], -1)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x rotated over its first cos.shape[-1] channels (all of a head, or its rotary_dim
        share under partial rotary), the rest passed through, as transformers' Phi3 does."""
        rotary = cos.shape[-1]
        if rotary < x.shape[-1]:
            rotated = CausalLM._rope(x[..., :rotary], cos, sin)
            return torch.cat((rotated, x[..., rotary:]), dim=-1)
        half = rotary // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, sin)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Run one step; returns float32 logits [len(logits_rows), vocab], or with `greedy`
        each row's argmax (int64 [len(logits_rows)], the first maximum) instead."""
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        qk_size = (heads + kv_heads) * dim
        rows = token_ids.shape[0]
        if self.long_rope is not None:
            positions = long_rope_rows(positions, meta, *self.long_rope)
        tables = {False: (self.cos, self.sin), True: (self.local_cos, self.local_sin)}
        if not self.fused:  # each distinct table indexed once (the local one is often global)
            picked = {False: (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))}
            picked[True] = (
                (self.local_cos[positions].unsqueeze(1), self.local_sin[positions].unsqueeze(1))
                if c.local_rope_theta
                else picked[False]
            )
        residual = F.embedding(token_ids, self.embed)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        normed = self._rms_norm(residual, self.layers[0].input_norm) if self.layers else residual
        for index, layer in enumerate(self.layers):
            local = c.layer_types[index] == "sliding_attention" if c.layer_types else False
            layer_meta = meta.windowed if layer.windowed and meta.windowed is not None else meta
            qkv = layer.qkv(normed)
            if layer.q_norm is not None:
                self._norm_heads(qkv, layer)
            # Queries and keys are rotated in one pass: they sit side by side in qkv (the
            # tables' width is the channels of each head that rotate: rotary_dim).
            if self.fused:
                cos, sin = tables[local]
                torch.ops.kiln.rope_(qkv, positions, cos, sin, heads + kv_heads, dim)
            # one native call for a decode-only step (queries and keys rotated in place)
            if self.fused and fused_decode(layer_meta, rows, self.dtype):
                attended = decode_attention(index, qkv, heads, cache, layer_meta, self.scale)
            else:
                if self.fused:
                    qk = qkv[:, :qk_size].unflatten(-1, (heads + kv_heads, dim))
                else:
                    qk = self._rope(
                        qkv[:, :qk_size].unflatten(-1, (heads + kv_heads, dim)), *picked[local]
                    )
                v = qkv[:, qk_size:].unflatten(-1, (kv_heads, dim))
                attended = paged_attention(
                    index, qk[:, :heads], qk[:, heads:], v, cache, layer_meta, self.scale
                )
            if attended.dtype != self.dtype:
                attended = attended.to(self.dtype)
            attn_out = layer.o_proj(attended)
            if layer.pre_mlp_norm is not None:  # Gemma 3: the attention output has its norm
                attn_out = self._rms_norm(attn_out, layer.post_norm)
                residual, normed = self._add_rms_norm(residual, attn_out, layer.pre_mlp_norm)
            else:
                residual, normed = self._add_rms_norm(residual, attn_out, layer.post_norm)
            mlp_out = layer.mlp(normed, self._silu_mul)
            if layer.post_mlp_norm is not None:
                mlp_out = self._rms_norm(mlp_out, layer.post_mlp_norm)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else None
            if following is None:
                residual = residual + mlp_out
            else:
                residual, normed = self._add_rms_norm(residual, mlp_out, following)
        selected = self._rms_norm(residual.index_select(0, logits_rows), self.norm)
        if greedy and self.greedy_head is not None:
            return self.greedy_head.argmax(selected)
        logits = self.lm_head(selected)
        return greedy_tokens(logits) if greedy else logits.float()
