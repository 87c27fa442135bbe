"""Capacity planner: will a quantised model fit a GPU target, how many sequences, at what cost.

Everything is computed from shapes (`ModelInfo`), the scheme and the target's figures;
nothing loads. Bases, so the numbers can be checked by hand:
- weights: each quantised linear at its bit width plus its scales (per tensor, channel or
  group; asymmetric groups add a 16-bit zero per group, TensorRT-LLM's layout); ignored
  linears, embeddings and norms stay 16-bit (the deployment dtype, bf16, whatever the
  source dtype). A tied lm_head is counted once.
- tensor parallel: attention heads, MLP columns and the lm_head vocab split over tp; KV heads
  split when tp divides them and are replicated (one per GPU) when they divide tp; the
  embedding table is replicated (trtllm-build's default, no parallel embedding). Pipeline
  parallel splits layers; the busiest stage is planned.
- KV cache: 2 (K and V) × layers × KV heads × head_dim × bytes of the KV dtype per token;
  a request holds whole blocks of tokens_per_block tokens up to max_seq_len.
- reserve: RUNTIME_BYTES (CUDA context, cuBLAS/TensorRT workspaces, allocator slack) +
  NCCL buffers when tp > 1 + activations of one decoder layer for max_num_tokens tokens in
  bf16 (residual, normed input, q/k/v, attention output, gate, up and their product; the
  engine reuses activation memory layer to layer) + fp32 logits of max_batch_size rows.
- KV capacity: what is left after weights and reserve, × kv_free_fraction (TensorRT-LLM's
  `free_gpu_memory_fraction`); sequences are counted at max_seq_len, so that number runs
  without eviction under any mix of lengths.
- decode roofline: memory bandwidth ÷ bytes one GPU reads per decode step at batch 1 (its
  weights without the embedding table, plus one sequence's KV at max_seq_len / 2): an upper
  bound on tokens/s per sequence, ignoring all-reduce and kernel efficiency.
- mixture of experts: every expert is resident (weights count them all; the router stays
  16-bit, never quantised); a decode step reads only num_experts_per_tok experts per sparse
  layer, so the roofline counts those.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kiln.compiler.trtllm.rules.support import check_algos, describe
from kiln.compiler.trtllm.targets import TargetProfile
from kiln.quant.selection import is_ignored
from kiln.quant.spec import Scheme
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.model_info import ModelInfo

GiB = 2**30
FLOAT16 = 2
RUNTIME_BYTES = 3 * GiB // 2
NCCL_BYTES = GiB // 2
TP_CHOICES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class DeploySpec:
    """The recipe's `deploy:` section: the serving shape the engine is built for."""

    max_seq_len: int = 4096
    max_input_len: int | None = None  # None: max_seq_len - 1
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    kv_free_fraction: float = 0.9
    tp_size: int | None = None  # None: the smallest tp that fits
    pp_size: int = 1
    tokens_per_block: int = 32
    gpu_price_per_hour: float | None = None  # per GPU
    expected_output_tokens_per_s: float | None = None  # whole deployment, all sequences

    def __post_init__(self) -> None:
        checks = [
            (self.max_seq_len >= 1, "max_seq_len must be at least 1"),
            (self.max_input_len is None or 1 <= self.max_input_len <= self.max_seq_len,
             f"max_input_len must be between 1 and max_seq_len ({self.max_seq_len})"),
            (self.max_batch_size >= 1, "max_batch_size must be at least 1"),
            (self.max_num_tokens >= 1, "max_num_tokens must be at least 1"),
            (0 < self.kv_free_fraction <= 1, "kv_free_fraction must be in (0, 1]"),
            (self.tp_size is None or self.tp_size >= 1, "tp_size must be at least 1"),
            (self.pp_size >= 1, "pp_size must be at least 1"),
            (self.tokens_per_block >= 1, "tokens_per_block must be at least 1"),
        ]  # fmt: skip
        bad = [message for ok, message in checks if not ok]
        if bad:
            raise UsageError("deploy: " + "; ".join(bad))


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's answer for one model × scheme × target × deploy shape (bytes are bytes)."""

    model: str
    target: str
    quant_algo: str
    kv_cache_quant_algo: str | None
    tp_size: int
    pp_size: int
    fits: bool
    memory_bytes_per_gpu: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_request: int
    kv_cache_bytes_per_gpu: int
    max_concurrent_sequences: int
    recommended_max_batch_size: int
    recommended_max_num_tokens: int
    decode_tokens_per_s_bound: float
    cost_per_million_output_tokens: float | None
    deploy: DeploySpec
    notes: tuple[str, ...] = ()
    suggestions: tuple[str, ...] = field(default_factory=tuple)
    # One decode step per GPU: the weight bytes it reads (idle experts and the embedding
    # table not), and the KV bytes each sequence adds at the mean context (max_seq_len / 2).
    decode_weight_read_bytes_per_gpu: int = 0
    decode_kv_read_bytes_per_sequence_per_gpu: int = 0

    @property
    def num_gpus(self) -> int:
        return self.tp_size * self.pp_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-able plan for the manifest and `--json` output."""
        data = asdict(self)
        data["num_gpus"] = self.num_gpus
        data["notes"], data["suggestions"] = list(self.notes), list(self.suggestions)
        return data


def cost_per_million(price_per_gpu_hour: float, gpus: int, tokens_per_s: float) -> float:
    """The price of a million output tokens from `gpus` GPUs producing `tokens_per_s`."""
    return price_per_gpu_hour * gpus / (tokens_per_s * 3600) * 1e6


def _weight_bits(algo: str) -> int:
    if algo == "NO_QUANT":
        return 16
    return 4 if algo.startswith("W4") or algo == "NVFP4" else 8


def linear_bytes(out: int, inp: int, algo: str, group_size: int | None, symmetric: bool) -> int:
    """Bytes of one (out, in) linear stored as TensorRT-LLM `algo`, scales included."""
    n = out * inp
    data = n * _weight_bits(algo) // 8
    if algo == "NO_QUANT":
        return data
    if algo == "NVFP4":
        return data + n // 16 + 8  # one fp8 scale per 16 values, fp32 global scales
    if algo == "FP8":
        return data + 8  # per-tensor weight and activation scales
    if algo == "FP8_BLOCK_SCALES":
        return data + 4 * math.ceil(out / 128) * math.ceil(inp / 128)
    if group_size is not None and algo.endswith(("_AWQ", "_GPTQ")):
        groups = out * math.ceil(inp / group_size)
        return data + groups * FLOAT16 * (1 if symmetric else 2)
    return data + out * 4  # per output channel fp32 scale (weight-only, SmoothQuant, rowwise)


def kv_dtype(kv_algo: str | None) -> float:
    """Bytes per KV cache element: 2 (bf16), 1 (FP8, INT8) or 0.5 (NVFP4, scales aside)."""
    return {"FP8": 1, "INT8": 1, "NVFP4": 0.5}.get(kv_algo or "", FLOAT16)


def kv_bytes_per_token(info: ModelInfo, kv_algo: str | None) -> int:
    """2 (K and V) × layers × KV heads × head_dim × KV dtype bytes, whole model."""
    return int(2 * info.num_layers * info.num_kv_heads * info.head_dim * kv_dtype(kv_algo))


def held_tokens(info: ModelInfo, layer: int, seq_len: int, block: int) -> int:
    """KV tokens decoder layer `layer` holds for one sequence of `seq_len` tokens: the whole
    context in whole blocks, or on a sliding-window layer at most its window and the block it
    straddles (TensorRT-LLM keeps a block pool per window size; vLLM's hybrid KV cache manager
    frees the blocks behind the window)."""
    full = math.ceil(seq_len / block) * block
    window = info.layer_window(layer)
    return full if window is None else min(full, (math.ceil(window / block) + 1) * block)


def mean_held_tokens(info: ModelInfo, seq_len: int, block: int) -> float:
    """`held_tokens` averaged over the decoder layers (seq_len rounded to blocks when no layer
    slides)."""
    layers = range(info.num_layers)
    return sum(held_tokens(info, i, seq_len, block) for i in layers) / info.num_layers


def _mean_read_tokens(info: ModelInfo, context: int) -> float:
    """The keys a decode step reads per layer at `context`, averaged over the layers."""
    windows = (info.layer_window(i) for i in range(info.num_layers))
    return sum(min(context, w or context) for w in windows) / info.num_layers


def _kv_heads_per_gpu(info: ModelInfo, tp: int) -> int:
    return info.num_kv_heads // tp if info.num_kv_heads % tp == 0 else 1


def tp_valid(info: ModelInfo, tp: int) -> bool:
    """Can `tp` split the heads: it divides the query heads and divides or is divided by
    the KV heads (which are then replicated, one per GPU)."""
    kv = info.num_kv_heads
    return info.num_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


@dataclass(frozen=True, slots=True)
class _Fit:
    """Memory of one tp choice, per GPU of the busiest pipeline stage."""

    tp: int
    weights: int  # whole model
    weights_gpu: int
    embedding: int
    reserve: int
    kv_token_gpu: int
    kv_cache: int
    sequences: int

    @property
    def fits(self) -> bool:
        return self.sequences >= 1


@dataclass(frozen=True, slots=True)
class _Case:
    """One model × scheme × target × deploy shape, sized at any tp."""

    info: ModelInfo
    algo: str
    kv_algo: str | None
    group_size: int | None
    symmetric: bool
    ignore: tuple[str, ...]
    target: TargetProfile
    deploy: DeploySpec

    def layer_bytes(self, layer: int, tp: int, active: bool = False) -> int:
        """Bytes of decoder layer `layer` on one GPU at `tp`: every expert of a sparse layer
        (all are resident), or with `active` only those one token reads."""
        info = self.info
        kv_share = _kv_heads_per_gpu(info, tp) / info.num_kv_heads
        total = 2 * info.hidden_size * FLOAT16  # two norms, replicated
        linears = info.active_linears(layer) if active else info.layer_linears(layer)
        router = f"{info.moe.block}.{info.moe.router}" if info.moe else None
        for name, (out, inp) in linears.items():
            ignored = name == router or is_ignored(f"model.layers.{layer}.{name}", self.ignore)
            size = linear_bytes(out, inp, "NO_QUANT" if ignored else self.algo,
                                self.group_size, self.symmetric)  # fmt: skip
            kv = name in ("self_attn.k_proj", "self_attn.v_proj")
            total += int(size * kv_share) if kv else size // tp
        return total

    def idle_expert_bytes(self, tp: int) -> int:
        """Bytes on one GPU that a decode step does not read: the experts a token is not
        routed to (0 for a dense model), per pipeline stage."""
        info = self.info
        idle = sum(self.layer_bytes(i, tp) - self.layer_bytes(i, tp, active=True)
                   for i in range(info.num_layers))  # fmt: skip
        return idle // self.deploy.pp_size

    def weights(self, tp: int) -> tuple[int, int, int]:
        """(whole model, busiest GPU, embedding table on it) in bytes."""
        info, pp = self.info, self.deploy.pp_size
        embedding = info.vocab_size * info.hidden_size * FLOAT16
        head_algo = "NO_QUANT" if is_ignored("lm_head", self.ignore) else self.algo
        lm_head = linear_bytes(info.vocab_size, info.hidden_size, head_algo, self.group_size,
                               self.symmetric)  # fmt: skip
        if info.tie_word_embeddings and head_algo == "NO_QUANT":
            lm_head = 0
        ln_f = info.hidden_size * FLOAT16
        full = sum(self.layer_bytes(i, 1) for i in range(info.num_layers))
        sharded = [self.layer_bytes(i, tp) for i in range(info.num_layers)]
        if pp == 1:
            gpu = sum(sharded) + embedding + lm_head // tp + ln_f
        else:
            stage = max(sharded) * math.ceil(info.num_layers / pp)
            gpu = stage + max(embedding, lm_head // tp + ln_f)
        return full + embedding + lm_head + ln_f, gpu, embedding

    def reserve(self, tp: int, max_num_tokens: int) -> int:
        info = self.info
        q = info.num_heads * info.head_dim // tp
        kv = _kv_heads_per_gpu(info, tp) * info.head_dim
        per_token = 2 * info.hidden_size + q + 2 * kv + q + 3 * info.intermediate_size // tp
        logits = self.deploy.max_batch_size * info.vocab_size * 4
        nccl = NCCL_BYTES if tp > 1 else 0
        return RUNTIME_BYTES + nccl + max_num_tokens * per_token * FLOAT16 + logits

    def fit(self, tp: int, max_num_tokens: int | None = None) -> _Fit:
        d, info = self.deploy, self.info
        weights, weights_gpu, embedding = self.weights(tp)
        reserve = self.reserve(tp, max_num_tokens or d.max_num_tokens)
        layers = math.ceil(info.num_layers / d.pp_size)
        heads = _kv_heads_per_gpu(info, tp)
        kv_token = int(2 * layers * heads * info.head_dim * kv_dtype(self.kv_algo))
        kv_request = math.ceil(kv_token * mean_held_tokens(info, d.max_seq_len, d.tokens_per_block))
        free = self.target.memory_bytes - weights_gpu - reserve
        kv_cache = int(max(free, 0) * d.kv_free_fraction)
        return _Fit(tp, weights, weights_gpu, embedding, reserve, kv_token, kv_cache,
                    kv_cache // kv_request)  # fmt: skip

    def smallest_fit(self) -> _Fit | None:
        tps = [self.deploy.tp_size] if self.deploy.tp_size else TP_CHOICES
        fits = (self.fit(tp) for tp in tps if tp_valid(self.info, tp))
        return next((f for f in fits if f.fits), None)

    def with_scheme(self, algo: str, group_size: int | None, symmetric: bool) -> _Case:
        deploy = replace(self.deploy, tp_size=None)
        return replace(self, algo=algo, group_size=group_size, symmetric=symmetric, deploy=deploy)


# Smaller schemes to offer when a model does not fit, most accurate first, as the TensorRT-LLM
# algorithm each recipe (describe() names it) resolves to: (algo, group size, symmetric).
_CANDIDATES = (("FP8", None, True), ("W8A16", None, True), ("W4A16_AWQ", 128, False))


def _smaller_scheme(case: _Case, needed: int | None) -> str | None:
    """The most accurate smaller scheme the target runs that fits on fewer GPUs."""
    for candidate in _CANDIDATES:
        other = case.with_scheme(*candidate)
        if _weight_bits(other.algo) >= _weight_bits(case.algo):
            continue
        paths = [p for p in ("engine", "pytorch")
                 if not check_algos(other.algo, case.kv_algo, case.target, p)]  # fmt: skip
        fit = other.smallest_fit() if paths else None
        if fit is not None and (needed is None or fit.tp < needed):
            only = f", {paths[0]} path only" if len(paths) == 1 else ""
            return f"fits with {describe(other.algo)}{only} at tp={fit.tp}"
    return None


def _suggestions(case: _Case, chosen: _Fit) -> list[str]:
    """What would make a plan that does not fit, fit."""
    out: list[str] = []
    auto = replace(case, deploy=replace(case.deploy, tp_size=None)).smallest_fit()
    needed = auto.tp if auto else None
    if needed is None:
        out.append(f"does not fit {case.target.name} at tp ≤ 8 with {case.algo}")
    elif needed != chosen.tp:
        out.append(f"needs tp={needed} ({needed} × {case.target.name})")
    smaller = _smaller_scheme(case, needed)
    if smaller:
        out.append(smaller)
    room = chosen.weights_gpu + chosen.reserve < case.target.memory_bytes
    if room and case.kv_algo is None:
        out.append("kv_cache: fp8 halves the KV cache per request")
    block = case.deploy.tokens_per_block
    tokens = chosen.kv_cache // max(chosen.kv_token_gpu, 1) // block * block
    if tokens >= block:
        out.append(f"or max_seq_len ≤ {tokens}")
    return out


def plan(info: ModelInfo, scheme: Scheme, target: TargetProfile, deploy: DeploySpec) -> Plan:
    """Memory, capacity and cost of serving `info` quantised with `scheme` on `target`.

    With `deploy.tp_size` None the smallest tp that fits is chosen (tp=8 when none does).
    """
    algo, kv_algo = scheme.trtllm_quant_algo, scheme.trtllm_kv_cache_quant_algo
    case = _Case(info, algo, kv_algo, scheme.group_size, scheme.symmetric, scheme.spec.ignore,
                 target, deploy)  # fmt: skip
    if deploy.tp_size is not None and not tp_valid(info, deploy.tp_size):
        works = " or ".join(str(t) for t in TP_CHOICES if tp_valid(info, t))
        raise UsageError(f"deploy.tp_size: {deploy.tp_size} cannot split the model's "
                         f"{info.num_heads} attention heads and {info.num_kv_heads} KV heads "
                         f"— use {works}")  # fmt: skip
    valid = [t for t in TP_CHOICES if tp_valid(info, t)]
    chosen = case.smallest_fit() or case.fit(deploy.tp_size or valid[-1])
    notes: list[str] = []
    if deploy.tp_size is None and chosen.tp > 1 and chosen.fits:
        notes.append(f"needs tp={chosen.tp}: does not fit one {target.name}")
    max_num_tokens = deploy.max_num_tokens
    budget = max_num_tokens // 2
    while not chosen.fits and budget >= 512:  # a smaller token budget leaves more for KV
        smaller = case.fit(chosen.tp, budget)
        if smaller.fits:
            notes.append(f"fits only with max_num_tokens ≤ {budget}")
            chosen, max_num_tokens = smaller, budget
        budget //= 2
    suggestions = _suggestions(case, chosen) if not chosen.fits else []
    if chosen.fits and chosen.tp > 1:
        smaller_scheme = _smaller_scheme(case, chosen.tp)
        suggestions = [smaller_scheme] if smaller_scheme else []
    if chosen.tp > 1 and not target.nvlink:
        notes.append(f"{target.name} has no NVLink: tp={chosen.tp} all-reduces over PCIe")
    if deploy.max_seq_len > info.max_position_embeddings:
        notes.append(f"max_seq_len {deploy.max_seq_len} exceeds the model's "
                     f"max_position_embeddings {info.max_position_embeddings}")  # fmt: skip
    input_len = deploy.max_input_len or deploy.max_seq_len - 1
    if input_len > max_num_tokens:
        notes.append(f"max_input_len {input_len} > max_num_tokens {max_num_tokens}: "
                     "build with chunked context (--use_paged_context_fmha enable)")  # fmt: skip
    notes += [str(p) for p in check_algos(algo, kv_algo, target, "both")]

    kv_token = kv_bytes_per_token(info, kv_algo)
    held = mean_held_tokens(info, deploy.max_seq_len, deploy.tokens_per_block)
    sliding = [i for i in range(info.num_layers) if info.layer_window(i) is not None]
    if sliding:
        notes.append(f"{len(sliding)} of {info.num_layers} layers attend within a sliding "
                     f"window of {info.sliding_window} tokens and hold only it in the KV "
                     "cache")  # fmt: skip
    read = chosen.weights_gpu - chosen.embedding - case.idle_expert_bytes(chosen.tp)
    kv_read = chosen.kv_token_gpu * _mean_read_tokens(info, deploy.max_seq_len // 2)
    step = read + kv_read
    cost = None
    if deploy.gpu_price_per_hour and deploy.expected_output_tokens_per_s:
        gpus = chosen.tp * deploy.pp_size
        cost = cost_per_million(
            deploy.gpu_price_per_hour, gpus, deploy.expected_output_tokens_per_s
        )
    return Plan(
        model=info.architecture,
        target=target.name,
        quant_algo=algo,
        kv_cache_quant_algo=kv_algo,
        tp_size=chosen.tp,
        pp_size=deploy.pp_size,
        fits=chosen.fits,
        memory_bytes_per_gpu=target.memory_bytes,
        weight_bytes=chosen.weights,
        weight_bytes_per_gpu=chosen.weights_gpu,
        reserve_bytes_per_gpu=chosen.reserve,
        kv_bytes_per_token=kv_token,
        kv_bytes_per_token_per_gpu=chosen.kv_token_gpu,
        kv_bytes_per_request=math.ceil(kv_token * held),
        kv_cache_bytes_per_gpu=chosen.kv_cache,
        max_concurrent_sequences=chosen.sequences,
        recommended_max_batch_size=min(deploy.max_batch_size, chosen.sequences),
        recommended_max_num_tokens=max_num_tokens,
        decode_tokens_per_s_bound=target.memory_bandwidth_gb_s * 1e9 / step,
        cost_per_million_output_tokens=cost,
        deploy=deploy,
        notes=tuple(notes),
        suggestions=tuple(suggestions),
        decode_weight_read_bytes_per_gpu=math.ceil(read),
        decode_kv_read_bytes_per_sequence_per_gpu=math.ceil(kv_read),
    )
