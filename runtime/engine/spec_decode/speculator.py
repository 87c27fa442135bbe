"""Speculative decoding: a cheap proposer drafts k tokens, the target verifies them in one pass.

After every engine step, each running request in its decode phase gets up to k draft tokens
(`Request.spec_token_ids`) from a proposer: a draft model with its own paged KV cache, block
pool and model runner (`DraftProposer`), or prompt lookup (`ngram_propose`), which drafts the
tokens that followed the latest earlier occurrence of the context's last n tokens. The next
step schedules 1 + k tokens for the request, and the target's forward computes all 1 + k
positions at the end of its context inside the ordinary batched step; rejection.py decides
what is emitted. Rejected positions are rolled back in both KV caches: each keeps exactly the
blocks its computed tokens need. Requests with `SamplingParams(speculative=False)` and all
requests while more than `disable_by_batch_size` run decode one token per step.

The analytic model (Leviathan et al. 2023): with per-token acceptance rate a and draft length
k, a verifying pass yields (1 - a^(k+1)) / (1 - a) tokens on average, and costs k·c + 1 target
passes when a draft step costs c of a target step.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.kv_cache import KVCacheManager, build_kv_cache
from kiln.runtime.engine.loader import KVCacheSpec, load_model
from kiln.runtime.engine.model import CausalLM
from kiln.runtime.engine.model_runner import ModelRunner
from kiln.runtime.engine.sampling import SamplingParams, draw, probabilities
from kiln.runtime.engine.scheduler import SchedulerOutput
from kiln.runtime.engine.sequence import Request
from kiln.runtime.engine.spec_decode.rejection import accept_greedy, rejection_sample
from kiln.runtime.formats.artifact import Manifest, member_path

METHODS = ("draft", "ngram")
# Measured on the 2-core CPU with SmolLM2-135M (tests/benchmarks/speculative_decoding.py),
# prompt lookup with k = 8 on extractive prompts, greedy: 2.9x the plain throughput with 1
# request running, 1.6x with 4, 1.1x with 16, 1.0x with 32. Past 16, verifying k + 1
# positions per request costs about what it saves (and less favourable drafts lose sooner).
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(slots=True)
class SpeculativeConfig:
    """How to speculate: the proposer, draft length k, and when to stop speculating."""

    method: str = "draft"  # "draft" (a draft model) or "ngram" (prompt lookup)
    draft: str | Path | None = None  # draft model dir or kiln artifact dir (method "draft")
    num_speculative_tokens: int = 4  # k
    ngram_min: int = 1
    ngram_max: int = 4
    # Plain decoding while more requests run than this; None: DEFAULT_DISABLE_BY_BATCH_SIZE.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.method not in METHODS:
            problems.append(f"method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            problems.append(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            problems.append(
                f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max ({self.ngram_max})"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            problems.append(f"disable_by_batch_size={self.disable_by_batch_size} must be >= 1")
        if problems:
            raise UsageError("invalid speculative config: " + "; ".join(problems))


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens one verifying pass yields on average: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Wall-time speedup over plain decoding: tokens per pass / (k·c + 1)."""
    return expected_tokens_per_pass(alpha, k) / (k * cost_ratio + 1.0)


def choose_draft_len(alpha: float, cost_ratio: float, max_k: int = 8) -> int:
    """The k in 1..max_k that maximises `expected_speedup` (callers should check that the
    speedup there exceeds 1 before speculating at all)."""
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio))


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory from a model dir or a kiln artifact dir (its `model/`)."""
    path = Path(path)
    if (path / "manifest.json").is_file() and (path / "model" / "config.json").is_file():
        return path / "model"
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{path}: not a kiln artifact (no manifest.json) and not a Hugging Face checkpoint "
            "directory (no config.json); pass one of those"
        )
    return path


def from_manifest(
    manifest: Manifest, artifact: Path, speculative: SpeculativeConfig | bool | None
) -> SpeculativeConfig | None:
    """The speculative config for an artifact: `speculative` when it is a config, off when
    False, else what the manifest's `speculative` entry describes (`{"draft": "draft",
    "max_draft_len": K, ...}`, the draft a nested artifact), or None when it has none."""
    if isinstance(speculative, SpeculativeConfig) or speculative is False:
        return speculative or None
    entry = manifest.speculative
    if entry is None:
        return None
    # `kiln compile` measured this draft on its build machine and found it slower than plain
    # decoding: off unless the caller asks for it (speculative=True).
    if entry.pays is False and speculative is not True:
        return None
    return SpeculativeConfig(
        method=entry.method,
        draft=member_path(artifact, entry.draft, "speculative.draft") if entry.draft else None,
        num_speculative_tokens=entry.max_draft_len or 4,
        ngram_max=entry.max_matching_ngram_size or 4,
        disable_by_batch_size=entry.disable_by_batch_size,
    )


def ngram_propose(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup: the k tokens after the latest earlier occurrence of the last n tokens,
    trying the longest n in [ngram_min, ngram_max] first; [] when nothing matches."""
    if k < 1 or len(tokens) < ngram_min + 1:
        return []
    # Search the int32 bytes with bytes.rfind (C speed), keeping only token-aligned hits.
    data = array("i", tokens).tobytes()
    width = array("i").itemsize
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = data[-n * width :]
        end = len(data) - width  # a match must end before the context's last token
        while (hit := data.rfind(suffix, 0, end)) >= 0:
            if hit % width == 0:
                start = hit // width + n
                return tokens[start : start + k]
            end = hit + len(suffix) - 1
    return []


@dataclass(slots=True)
class DraftSequence:
    """The draft model's copy of one target request: its tokens (the target's plus drafts)
    and its draft KV blocks."""

    request: Request
    synced: int = 0  # leading tokens known equal to the target's


class DraftProposer:
    """A draft model with its own paged KV cache and block pool, proposing for a batch."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        num_blocks: int,
        vocab_size: int,
        kv_spec: KVCacheSpec | None = None,
    ) -> None:
        cache = build_kv_cache(model, config, kv_spec or KVCacheSpec(), 0, num_blocks)
        self.model = model
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_caching=False)
        self.runner = ModelRunner(model, cache, greedy_steps=False)
        self.vocab_size = vocab_size
        self.sequences: dict[str, DraftSequence] = {}

    def release(self, request_id: str) -> None:
        """Free a request's draft blocks (finished, aborted or preempted)."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.kv.free(sequence.request)

    def _sync(self, target: Request) -> Request:
        """Bring the draft sequence level with the target's tokens; keep only KV still valid."""
        sequence = self.sequences.get(target.request_id)
        if sequence is None:
            request = Request(target.request_id, list(target.prompt_token_ids), SamplingParams())
            sequence = self.sequences[target.request_id] = DraftSequence(request)
        draft, tokens = sequence.request, target.all_token_ids
        own = draft.all_token_ids
        limit = min(len(own), len(tokens), draft.num_computed_tokens)
        same = min(sequence.synced, limit)
        while same < limit and own[same] == tokens[same]:
            same += 1
        draft.num_computed_tokens = same  # rejected draft positions roll back here
        self.kv.trim(draft, same)
        del own[same:]
        own.extend(tokens[same:])
        sequence.synced = len(tokens)
        return draft

    def propose(
        self, requests: list[Request], ks: list[int]
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Up to ks[i] draft tokens for each request, with the draft's processed
        distribution at each ([k, vocab]; None for greedy requests)."""
        copies = [self._sync(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for depth in range(max(ks, default=0)):
            batch, counts = [], []
            for i in active:
                own = copies[i]
                count = own.num_tokens - own.num_computed_tokens
                if ks[i] > depth and self.kv.allocate_slots(own, count):
                    batch.append(i)
                    counts.append(count)
            active = batch
            if not active:
                break
            step = self.runner.run(SchedulerOutput([copies[i] for i in active], counts))
            row_of = {id(request): row for request, row in step.sample_rows}
            rows = torch.tensor([row_of[id(copies[i])] for i in active], device=step.logits.device)
            logits = self._target_vocab(step.logits[rows])
            tokens = logits.argmax(dim=-1)
            sampled = [j for j, i in enumerate(active) if not requests[i].params.greedy]
            if sampled:
                chosen = torch.tensor(sampled, device=logits.device)
                dist = probabilities(logits[chosen], [requests[active[j]].params for j in sampled])
                tokens[chosen] = draw(dist, [requests[active[j]].generator for j in sampled])
                for row, j in enumerate(sampled):
                    probs[active[j]].append(dist[row])
            for i, count, token in zip(active, counts, tokens.tolist(), strict=True):
                copies[i].num_computed_tokens += count
                copies[i].all_token_ids.append(token)
                drafts[i].append(token)
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, probs, strict=True)]

    def _target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (embedding sizes may be padded apart)."""
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[:, : self.vocab_size]
        return F.pad(logits, (0, extra), value=float("-inf")) if extra else logits


@dataclass(slots=True)
class SpecStats:
    """Counters behind EngineStats' spec_decode_* fields, plus the trials per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Drafts whose position i was judged (every earlier draft token accepted).
    reached_per_pos: list[int] = field(default_factory=list)


class Speculator:
    """Proposes drafts after each step and turns verified rows into emitted tokens."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, proposer: DraftProposer | None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer
        k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * k, reached_per_pos=[0] * k)

    def propose(self, running: list[Request]) -> None:
        """Give each running decode-phase request its draft tokens for the next step."""
        limit = self.config.disable_by_batch_size or DEFAULT_DISABLE_BY_BATCH_SIZE
        if len(running) > limit:
            return
        chosen, ks = [], []
        for request in running:
            k = min(
                self.config.num_speculative_tokens,
                request.params.max_tokens - request.num_output_tokens - 1,
                self.max_model_len - request.num_tokens,
            )
            eligible = (
                request.params.speculative
                and not request.wants_prompt_logprobs
                and not request.params.processes_logits  # penalties read each token's past
            )
            if k >= 1 and eligible and request.num_tokens - request.num_computed_tokens == 1:
                chosen.append(request)
                ks.append(k)
        if self.proposer is not None:
            proposals = self.proposer.propose(chosen, ks)
        else:
            c = self.config
            proposals = [
                (ngram_propose(r.all_token_ids, k, c.ngram_min, c.ngram_max), None)
                for r, k in zip(chosen, ks, strict=True)
            ]
        for request, (drafts, probs) in zip(chosen, proposals, strict=True):
            request.spec_token_ids = drafts
            request.spec_probs = probs

    def accept(self, request: Request, logits: torch.Tensor, kv: KVCacheManager) -> list[int]:
        """The tokens a verifying pass emits from the target's logits rows [k + 1, vocab];
        counts the accepted drafts' positions as computed and frees the rejected ones' blocks."""
        drafts = request.spec_token_ids
        params = request.params
        if params.greedy:
            tokens = accept_greedy(logits, drafts)
        else:
            target = probabilities(logits, [params] * len(logits))
            tokens = rejection_sample(target, request.spec_probs, drafts, request.generator)
        accepted = len(tokens) - 1
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += len(drafts)
        stats.num_accepted_tokens += accepted
        for position in range(min(accepted + 1, len(drafts))):
            stats.reached_per_pos[position] += 1
            stats.accepted_per_pos[position] += position < accepted
        request.drop_spec()
        request.num_computed_tokens += accepted  # the accepted drafts' KV stays valid
        kv.trim(request, request.num_computed_tokens)
        return tokens

    def metrics(self) -> dict[str, Any]:
        """The EngineStats spec_decode_* fields."""
        s = self.stats
        return {
            "spec_decode_num_drafts": s.num_drafts,
            "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_pos),
        }

    def release(self, request: Request) -> None:
        request.drop_spec()
        if self.proposer is not None:
            self.proposer.release(request.request_id)


def build_speculator(
    config: SpeculativeConfig,
    target: CausalLM,
    engine_config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    draft_model: CausalLM | None = None,
) -> Speculator:
    """A Speculator for `target`, loading the draft model from `config.draft` unless given;
    the draft gets its own pool of `num_blocks` blocks."""
    proposer = None
    if config.method == "draft":
        kv_spec = None
        if draft_model is None:
            if config.draft is None:
                raise UsageError("speculative method 'draft' needs a draft model: set draft=DIR")
            draft_dir = resolve_model_dir(config.draft)
            draft_model, kv_spec = load_model(
                draft_dir, engine_config.dtype, target.device, max_model_len
            )
        vocab = target.config.vocab_size
        proposer = DraftProposer(draft_model, engine_config, num_blocks, vocab, kv_spec)
    return Speculator(config, max_model_len, proposer)
