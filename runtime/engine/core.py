"""Engine: requests in, tokens out, one scheduler step at a time.

`add_request` validates and queues a prompt, `step` runs one batched forward (continuous
batching: requests join and leave at every step) and returns each advanced request's new
tokens and text as a delta, `abort` frees a request's blocks at once, and `generate` drives
all of it for a list of prompts. `AsyncEngine` (async_engine.py) puts the step loop on a
background thread for servers. With a SpeculativeConfig, each step also verifies the draft
tokens proposed after the previous one and may emit several tokens per request
(speculative.py).
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

import torch

from kiln.runtime.base.errors import ArtifactError, UsageError
from kiln.runtime.base.files import irregular_entries
from kiln.runtime.engine.allocator import keep_freed_memory
from kiln.runtime.engine.config import EngineConfig, engine_config
from kiln.runtime.engine.detokenizer import Detokenizer
from kiln.runtime.engine.kv_cache import KVCacheManager, build_kv_cache
from kiln.runtime.engine.loader import KVCacheSpec, load_model
from kiln.runtime.engine.model import CausalLM
from kiln.runtime.engine.model_runner import ModelRunner, StepLogits
from kiln.runtime.engine.outputs import (
    ITERATION_TOKENS_BUCKETS,
    EngineStats,
    RequestOutput,
    delta_output,
    final_output,
)
from kiln.runtime.engine.processing import PromptLimits, logprob_entries, named, stop_status
from kiln.runtime.engine.sampling import (
    Logprob,
    SamplingParams,
    make_generator,
    process_logits,
    sample,
    token_logprobs,
)
from kiln.runtime.engine.scheduler import Scheduler, SchedulerOutput
from kiln.runtime.engine.sequence import Request, RequestStatus
from kiln.runtime.engine.spec_decode.speculator import (
    SpeculativeConfig,
    build_speculator,
    from_manifest,
    resolve_model_dir,
)

Prompt = str | list[int]


class RequestOptions(TypedDict, total=False):
    """What a request may set beyond its prompt and sampling parameters."""

    request_id: str  # default: req-N
    priority: int  # with the "priority" scheduling policy, lower runs first; default 0
    cache_salt: str  # only requests with the same salt share prefix-cache blocks


class Engine:
    """A paged-KV, continuously batching engine for one Llama-family model."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Any,
        config: EngineConfig | None = None,
        kv_spec: KVCacheSpec | None = None,
        eos_token_ids: Sequence[int] = (),
        speculative: SpeculativeConfig | None = None,
        draft_model: CausalLM | None = None,
    ) -> None:
        """`speculative` turns on speculative decoding; `draft_model` is an already loaded
        draft (else the draft is loaded from `speculative.draft`)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model.device.type == "cpu":
            keep_freed_memory()
        self.model = model
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.max_model_len = self._max_model_len(model, config)
        cache = build_kv_cache(model, config, kv_spec or KVCacheSpec(), self.max_model_len)
        self.num_blocks = cache.k[0].shape[1]
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(model, cache)
        self.speculator = None
        if speculative is not None:
            # One spare block per sequence: the draft runs k - 1 positions past the target.
            draft_blocks = self.num_blocks + config.max_num_seqs
            self.speculator = build_speculator(
                speculative, model, config, draft_blocks, self.max_model_len, draft_model
            )
        self.eos_token_ids = frozenset(eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.limits = PromptLimits(
            model.config.vocab_size,
            self.max_model_len,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            self.num_blocks,
            self.kv.blocks_needed,
        )
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._busy = 0.0
        self._iteration_buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_tokens = 0

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        tokenizer: Any = None,
        speculative: SpeculativeConfig | None = None,
        **config: Any,
    ) -> Engine:
        """Load a Hugging Face model directory (float, compressed-tensors or ModelOpt HF export)."""
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        unreadable = irregular_entries(model_dir) if model_dir.is_dir() else []
        if unreadable:
            raise ArtifactError(f"{model_dir}: holds what kiln does not read (regular files "
                                "only):\n  " + "\n  ".join(unreadable))  # fmt: skip
        options = engine_config(device=device, **config)
        model, kv_spec = load_model(
            model_dir, options.dtype, torch.device(device), options.max_model_len
        )
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        eos = set(_generation_eos(model_dir))
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(model, tokenizer, options, kv_spec, sorted(eos), speculative)

    @classmethod
    def from_artifact(
        cls,
        path: str | Path,
        device: str = "cpu",
        verify: bool = False,
        speculative: SpeculativeConfig | bool | None = None,
        **config: Any,
    ) -> Engine:
        """Load the model of a kiln artifact (`<artifact>/model/`); `verify` re-hashes every
        file against the manifest first. A manifest `speculative` entry (a nested draft
        artifact and its K) turns speculative decoding on unless `speculative=False`."""
        from kiln.runtime.formats.artifact import MODEL_DIR, load_manifest
        from kiln.runtime.formats.artifact import verify as verify_artifact

        speculative = from_manifest(load_manifest(path), Path(path), speculative)
        if verify and (problems := verify_artifact(path)):
            raise ArtifactError(f"{path}: artifact does not verify: " + "; ".join(problems))
        model_dir = Path(path) / MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise ArtifactError(f"{path}: artifact has no {MODEL_DIR}/config.json")
        return cls.from_pretrained(model_dir, device=device, speculative=speculative, **config)

    @classmethod
    def load(cls, path: str | Path, **options: Any) -> Engine:
        """Load whatever `path` is: a kiln artifact (`from_artifact`) or a Hugging Face
        checkpoint directory (`from_pretrained`). `options` are `from_artifact`'s: device,
        verify, speculative (a config, or for an artifact False/True to refuse/force the
        draft its manifest names) and engine settings."""
        from kiln.runtime.formats.artifact import MANIFEST

        if (Path(path) / MANIFEST).is_file():
            return cls.from_artifact(path, **options)
        model_dir = resolve_model_dir(path)  # a checkpoint directory, else UsageError
        if options.pop("verify", False):
            raise UsageError(f"{path}: verify needs a kiln artifact; a checkpoint has no digests")
        if not isinstance(options.get("speculative"), SpeculativeConfig):
            options.pop("speculative", None)  # True/False name a manifest's draft
        return cls.from_pretrained(model_dir, **options)

    # -- requests -------------------------------------------------------------------------

    def make_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        **options: Unpack[RequestOptions],
    ) -> Request:
        """Validate and tokenise a prompt into a Request without queueing it."""
        params = params or SamplingParams()
        request_id = options.get("request_id")
        if isinstance(prompt, str):
            if self.detokenizer is None:
                raise UsageError("this engine has no tokenizer: pass token ids, not text")
            token_ids = self.detokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.limits.check(rid, token_ids, params)
        request = Request(
            rid,
            token_ids,
            params,
            priority=options.get("priority", 0),
            cache_salt=options.get("cache_salt"),
        )
        request.generator = make_generator(params.seed, self.model.device)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * min(params.prompt_logprobs_start, len(token_ids))
        if self.detokenizer is not None:
            self.detokenizer.start(request)
        return request

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        **options: Unpack[RequestOptions],
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id."""
        request = self.make_request(prompt, params, **options)
        self.add(request)
        return request.request_id

    def add(self, request: Request) -> None:
        """Queue a Request built by `make_request`."""
        if request.request_id in self.requests:
            raise UsageError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or finished."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        self.requests.pop(request.request_id, None)
        if self.speculator is not None:
            self.speculator.release(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, so the next requests are computed in full (as a
        fresh engine would); the cache's counters in `stats()` keep counting."""
        if self.has_unfinished_requests():
            raise UsageError(
                "reset_prefix_cache: requests are still running; let them finish or abort "
                "them first"
            )
        self.kv.pool.reset_prefix_cache()

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batched forward; returns a delta for every request that got a token."""
        began = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.requests:
            return []
        with torch.inference_mode():
            logits = self.runner.run(scheduled)
            outputs = self._update(scheduled, logits)
            if self.speculator is not None:
                for request in scheduled.preempted:
                    self.speculator.release(request)
                self.speculator.propose(self.scheduler.running)
        self._steps += 1
        self._busy += time.perf_counter() - began
        tokens = sum(scheduled.num_new_tokens)
        self._iteration_buckets[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self._iteration_tokens += tokens
        return outputs

    def _update(self, scheduled: SchedulerOutput, step: StepLogits) -> list[RequestOutput]:
        logits = step.logits
        for request, row, begin, count in step.prompt_rows:
            logprobs = torch.log_softmax(logits[row : row + count], dim=-1)
            targets = torch.tensor(
                request.prompt_token_ids[begin + 1 : begin + 1 + count], device=logits.device
            )
            top_n = [request.params.prompt_logprobs or 0] * count
            prompt_entries = token_logprobs(logprobs, targets, top_n)
            request.prompt_logprobs.extend(named(self.detokenizer, prompt_entries))
        for request, count in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            # Draft positions count as computed only once accepted (`_verify`).
            request.num_computed_tokens += count - len(request.spec_token_ids)
            self.kv.cache_full_blocks(request)
        outputs = []
        plain = [(r, row) for r, row in step.sample_rows if not r.spec_token_ids]
        if plain:
            requests = [request for request, _ in plain]
            index = [row for _, row in plain]
            if step.tokens is not None:  # greedy rows without log-probabilities: argmaxes
                tokens, rows = step.tokens[torch.tensor(index, device=logits.device)], logits
            else:
                if index == list(range(logits.shape[0])):  # every row, in order: no copy
                    rows = logits
                else:
                    rows = logits[torch.tensor(index, device=logits.device)]
                params = [r.params for r in requests]
                processed = process_logits(
                    rows, params, [r.prompt_token_ids for r in requests],
                    [r.output_token_ids for r in requests],
                    [self._stop_ids(r.params) for r in requests],
                )  # fmt: skip
                tokens = sample(processed, params, [r.generator for r in requests])
            entries = logprob_entries(self.detokenizer, requests, rows, tokens)
            for request, token, entry in zip(requests, tokens.tolist(), entries, strict=True):
                self._emit(request, token, entry)
                outputs.append(delta_output(request))
        for request, row in step.sample_rows:
            if request.spec_token_ids:
                width = len(request.spec_token_ids) + 1
                outputs.append(self._verify(request, logits[row : row + width]))
        return outputs

    def _verify(self, request: Request, rows: torch.Tensor) -> RequestOutput:
        """Emit the tokens a verifying pass accepts; roll back the rejected KV positions."""
        assert self.speculator is not None
        tokens = self.speculator.accept(request, rows, self.kv)
        chosen = torch.tensor(tokens, device=rows.device)
        entries = logprob_entries(
            self.detokenizer, [request] * len(tokens), rows[: len(tokens)], chosen
        )
        for token, entry in zip(tokens, entries, strict=True):
            if self._emit(request, token, entry):
                break  # a stop inside the accepted run drops the tokens after it
        if not request.finished:
            self.kv.cache_full_blocks(request)
        return delta_output(request)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that stop a request: its stop_token_ids and, unless ignore_eos, eos."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def _emit(self, request: Request, token: int, entry: dict[int, Logprob] | None) -> bool:
        """Append one token and apply the stop rules; True when that finished the request."""
        if not request.output_token_ids:
            self._prompt_tokens += request.num_prompt_tokens
        request.append_token(token)
        self._generation_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        if entry is not None:
            request.logprobs.append(entry)
        status = stop_status(request, token, self.eos_token_ids, self.max_model_len,
                             self.detokenizer)  # fmt: skip
        if status is not None:
            self._finish(request, status)
        return status is not None

    # -- outputs --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (texts or token-id lists) to completion; outputs in prompt order."""
        if isinstance(params, SamplingParams) or params is None:
            per_prompt = [params or SamplingParams()] * len(prompts)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(prompts):
                raise UsageError(
                    f"generate: {len(prompts)} prompts but {len(per_prompt)} sampling params; "
                    "pass one SamplingParams or one per prompt"
                )
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        for request in requests:
            self.add(request)
        while any(not r.finished for r in requests):
            self.step()
        return [final_output(r) for r in requests]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks=self.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._steps,
            busy_seconds=self._busy,
            iteration_tokens_buckets=list(self._iteration_buckets),
            iteration_tokens_sum=self._iteration_tokens,
            cache_config={
                "block_size": str(self.config.block_size),
                "num_gpu_blocks": str(self.num_blocks),
                "cache_dtype": str(self.config.kv_cache_dtype),
                "enable_prefix_caching": str(self.config.enable_prefix_caching),
            },
            **(self.speculator.metrics() if self.speculator is not None else {}),
        )

    # -- sizing ---------------------------------------------------------------------------

    @staticmethod
    def _max_model_len(model: CausalLM, config: EngineConfig) -> int:
        c = model.config
        limit = c.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise UsageError(
                f"max_model_len={config.max_model_len} exceeds the model's {limit} "
                "(max_position_embeddings); lower it"
            )
        return config.max_model_len


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return eos if isinstance(eos, list) else [] if eos is None else [int(eos)]
