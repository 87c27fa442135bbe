"""`kiln draft TARGET`: make a speculative-decoding draft for a model that has none.

The draft is a shallow copy of the target: its first N decoder layers, its final norm and its
LM head (and embeddings), so it shares the tokenizer by construction. Optionally it is then
distilled on the target's own next-token distributions (KL(target ‖ draft)) over calibration
text for S steps, training only the copied layers and the final norm: the embeddings and the
head stay the target's, which keeps the draft's output space the target's and the optimiser
small enough for a CPU. Last, its acceptance α (per draft position) and cost ratio c against
the target are measured (runtime.speculative.measure_acceptance) on held-out text, and the
best K is reported with the formula's speedup and the one timed on this machine (target
alone vs target + draft, compiler.speculative.measure_speedup): the timed one says whether
it pays.

Layer truncation and this distillation loop are ours: no library we use cuts a model to its
first layers, and the loop is a dozen lines of torch (transformers' Trainer would bring
datasets/accelerate machinery for what is one loss and one optimiser here).
"""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.compiler import sources
from kiln.compiler.draft.speculation import TIMED_PROMPTS, measure_speedup
from kiln.quant import calibration
from kiln.quant.spec import CalibrationSpec
from kiln.runtime.base.cache import cache_home
from kiln.runtime.base.errors import SourceError, UsageError
from kiln.runtime.formats.safetensors_writer import SHARD_BYTES
from kiln.runtime.formats.tokenizer_files import save_tokenizer

PROVENANCE = "kiln-draft.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


@dataclass
class DraftOptions:
    """How to cut, distil and measure a draft (the `kiln draft` options)."""

    layers: int | None = None  # None: default_layers(target)
    distill_steps: int = 100  # ≈2.5 min for SmolLM2-135M on 2 CPU cores
    dataset: str = "builtin:licenses"
    seq_len: int = 64
    batch_size: int = 4
    learning_rate: float = 1e-3
    seed: int = 0
    measure: bool = True
    prompts: int = 8
    max_tokens: int = 32
    max_k: int = 8


@dataclass
class DraftReport:
    """What `kiln draft` made and measured."""

    path: str
    target: str
    target_layers: int
    layers: int
    target_parameters: int
    parameters: int
    distill_steps: int
    # KL(target ‖ draft) per token on the first distillation batch, before and after
    kl_before: float | None = None
    kl_after: float | None = None
    seconds_distilling: float = 0.0
    acceptance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_layers(num_layers: int) -> int:
    """A sixth of the target's layers (at least 1, fewer than the target's)."""
    return max(1, min(num_layers - 1, round(num_layers / 6)))


def target_model_dir(target: str, base_dir: Path | None = None) -> tuple[Path, str]:
    """A float HF directory for a model source (materialised into kiln's user cache)."""
    ref = sources.parse_source(target, base_dir or Path.cwd())
    info = sources.inspect_source(ref)
    if info.config.get("quantization_config"):
        raise SourceError(
            f"{target}: holds a quantised checkpoint; a draft is cut from float weights — "
            "pass the model the artifact was compiled from (its manifest's source.spec)"
        )
    problems = sources.check_architecture(info)
    if problems:
        raise SourceError(f"{target}: " + "; ".join(problems))
    return sources.materialize(ref, cache_home() / "sources"), ref.spec


def shallow_copy(model: Any, layers: int) -> Any:
    """A model of the same class with the first `layers` decoder layers, the final norm, the
    embeddings and the LM head of `model` (weights copied)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    total = int(config.num_hidden_layers)
    if not 1 <= layers < total:
        raise UsageError(
            f"--layers {layers}: a draft keeps 1 to {total - 1} of the target's {total} layers"
        )
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):  # per-layer attention kinds (Qwen2, ...)
        config.layer_types = list(config.layer_types)[:layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if (index := _layer_index(name)) is None or index < layers
    }
    missing, unexpected = draft.load_state_dict(kept, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise UsageError(
            f"cannot cut {type(model).__name__}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    if config.tie_word_embeddings:
        draft.tie_weights()
    return draft.eval()


def _layer_index(name: str) -> int | None:
    """N of a `...layers.N...` parameter name; None outside the decoder layers."""
    parts = name.split(".")
    for a, b in itertools.pairwise(parts):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def training_batches(texts: list[str], tokenizer: Any, seq_len: int, batch_size: int) -> list[Any]:
    """Calibration text as [batch, seq_len] token batches (one long stream, cut evenly)."""
    import torch

    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            stream.append(tokenizer.eos_token_id)
    rows = len(stream) // seq_len
    if rows < batch_size:
        raise UsageError(
            f"the distillation text holds {len(stream)} tokens, fewer than one "
            f"batch of {batch_size}×{seq_len}: use a larger --dataset or a "
            "smaller --seq-len"
        )
    tokens = torch.tensor(stream[: rows * seq_len]).view(rows, seq_len)
    return [tokens[i : i + batch_size] for i in range(0, rows - batch_size + 1, batch_size)]


def kl_divergence(target: Any, draft: Any, batch: Any) -> Any:
    """Mean KL(target ‖ draft) per token of the next-token distributions on `batch`."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        teacher = F.log_softmax(target(input_ids=batch).logits.float(), dim=-1)
    student = F.log_softmax(draft(input_ids=batch).logits.float(), dim=-1)
    return F.kl_div(
        student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean"
    )


def distill(
    target: Any,
    draft: Any,
    batches: list[Any],
    steps: int,
    learning_rate: float,
    progress: Callable[[str], None],
) -> list[float]:
    """Train the draft's layers and final norm towards the target's next-token distributions
    (mean KL(target ‖ draft) per token) for `steps` batches; returns the loss of each step."""
    import torch

    frozen = {id(draft.get_input_embeddings().weight), id(draft.get_output_embeddings().weight)}
    trained = [p for p in draft.parameters() if id(p) not in frozen]
    for p in draft.parameters():
        p.requires_grad_(id(p) not in frozen)
    optimiser = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.0)
    losses: list[float] = []
    draft.train()
    for step in range(steps):
        loss = kl_divergence(target, draft, batches[step % len(batches)])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimiser.step()
        losses.append(loss.detach().item())
        if step % 10 == 0 or step == steps - 1:
            progress(f"distilling: step {step + 1}/{steps}, KL {losses[-1]:.4f}")
    draft.eval()
    for p in draft.parameters():
        p.requires_grad_(False)
    return losses


def make_draft(
    target: str,
    out: Path,
    options: DraftOptions,
    progress: Callable[[str], None] = lambda _: None,
) -> DraftReport:
    """Cut (and optionally distil) a draft of `target` into the HF directory `out`, then
    measure its acceptance and cost ratio against the target."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--output {out}: exists and is not empty; choose a new directory")
    progress(f"loading {target}")
    model_dir, spec = target_model_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    total = int(model.config.num_hidden_layers)
    layers = options.layers if options.layers is not None else default_layers(total)
    torch.manual_seed(options.seed)
    draft = shallow_copy(model, layers)
    report = DraftReport(
        str(out), spec, total, layers, _count(model), _count(draft), options.distill_steps
    )
    data = CalibrationSpec(
        dataset=options.dataset,
        num_samples=max(8, options.distill_steps),
        max_seq_len=options.seq_len,
        seed=options.seed,
    )
    seen: list[str] = []
    if options.distill_steps > 0:
        seen = calibration.load_texts(data, tokenizer)
        batches = training_batches(seen, tokenizer, options.seq_len, options.batch_size)
        # One fixed batch measured before and after: step losses are on different batches.
        with torch.no_grad():
            report.kl_before = round(float(kl_divergence(model, draft, batches[0])), 4)
        began = time.perf_counter()
        distill(model, draft, batches, options.distill_steps, options.learning_rate, progress)
        report.seconds_distilling = round(time.perf_counter() - began, 1)
        with torch.no_grad():
            report.kl_after = round(float(kl_divergence(model, draft, batches[0])), 4)
    _save(draft, tokenizer, model_dir, out)
    del model
    if options.measure:
        progress("measuring acceptance and cost ratio against the target")
        report.acceptance = measure(model_dir, out, data, options, tokenizer, exclude=seen)
    (out / PROVENANCE).write_text(json.dumps(report.to_dict(), indent=2, sort_keys=True) + "\n")
    return report


def measure(
    target_dir: Path,
    draft_dir: Path,
    data: CalibrationSpec,
    options: DraftOptions,
    tokenizer: Any,
    exclude: list[str],
) -> dict[str, Any]:
    """α per position, c, and the best K with its expected speedup, on held-out prompts."""
    from kiln.compiler.draft.acceptance import measure_acceptance
    from kiln.runtime.engine.spec_decode.speculator import choose_draft_len, expected_speedup

    held_out = calibration.load_texts(
        CalibrationSpec(
            dataset=data.dataset,
            num_samples=options.prompts,
            max_seq_len=data.max_seq_len,
            seed=data.seed + 1,
        ),
        tokenizer,
        exclude=exclude,
    )
    prompts = [tokenizer.decode(ids[:64]) for ids in calibration.tokenize(held_out, tokenizer, 64)]
    if not prompts:
        raise UsageError(f"--dataset {data.dataset}: no held-out text left to measure on")
    profile = measure_acceptance(
        target_dir,
        draft_dir,
        prompts,
        max_k=options.max_k,
        max_tokens=options.max_tokens,
        device="cpu",
    )
    k = choose_draft_len(profile.alpha, profile.cost_ratio, max_k=options.max_k)
    timed = measure_speedup(target_dir, draft_dir, prompts[:TIMED_PROMPTS], k, options.max_tokens)
    return {
        "alpha": round(profile.alpha, 4),
        "alpha_per_position": [round(a, 4) for a in profile.alpha_per_position],
        "cost_ratio": round(profile.cost_ratio, 4),
        "draft_ms_per_token": round(profile.draft_ms_per_token, 3),
        "target_ms_per_token": round(profile.target_ms_per_token, 3),
        "num_drafts": profile.num_drafts,
        "best_k": k,
        "expected_speedup": round(expected_speedup(profile.alpha, k, profile.cost_ratio), 3),
        **timed.to_dict(),
        "prompts": len(prompts),
        "max_tokens": options.max_tokens,
    }


def _count(model: Any) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _save(draft: Any, tokenizer: Any, model_dir: Path, out: Path) -> None:
    """The draft as an HF directory with the target's own tokenizer files, byte for byte."""
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out, max_shard_size=SHARD_BYTES)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    if not (out / "tokenizer_config.json").is_file():  # a tokenizer without files of its own
        save_tokenizer(tokenizer, out)
