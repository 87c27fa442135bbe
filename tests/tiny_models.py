"""Tiny, deterministic, random Llama-family checkpoints with a real BPE tokenizer.

Unit tests quantise these in seconds. The tokenizer is trained offline on the licence texts
every Debian machine carries, so nothing is downloaded.
"""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

LICENSES = Path("/usr/share/common-licenses")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIGS = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mixtral": MixtralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "phi3": Phi3Config,
    "gemma3_text": Gemma3TextConfig,
}
# Mixture-of-experts fixtures: 4 experts, 2 per token, experts half the dense MLP's width.
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}


def corpus_text(limit_chars: int = 400_000) -> str:
    """Licence texts, concatenated in a fixed order, up to limit_chars."""
    parts: list[str] = []
    total = 0
    for path in sorted(LICENSES.iterdir()):
        if path.is_file():
            text = path.read_text(errors="ignore")
            parts.append(text)
            total += len(text)
            if total >= limit_chars:
                break
    return "\n".join(parts)[:limit_chars]


def train_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the licence corpus, deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_text()
    tok.train_from_iterator([text[i : i + 2000] for i in range(0, len(text), 2000)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: Path,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    partial_rotary_factor: float | None = None,
    **extra: object,
) -> Path:
    """Write a random `arch` checkpoint (float32) and its tokenizer to `path`; `extra`: more
    config fields (a MoE model's experts). `partial_rotary_factor`: the share of each head
    RoPE rotates (Phi-3's config reads it: 0.75 as Phi-4-mini); None leaves the key out."""
    tokenizer = train_tokenizer(vocab_size)
    if partial_rotary_factor is not None:
        extra = {**extra, "partial_rotary_factor": partial_rotary_factor}
    if arch == "mixtral":  # each expert as wide as intermediate_size
        extra = {**MOE, **extra}
    if arch == "qwen3_moe":
        extra = {**MOE, "moe_intermediate_size": intermediate_size // 2, **extra}
    config = CONFIGS[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        head_dim=head_dim or hidden_size // num_heads,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init at std 0.02 gives near-uniform logits; widen it so quantisation error and
    # greedy continuations are measurable in tests.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(
                    0.0,
                    0.08,
                    generator=torch.Generator().manual_seed(
                        seed * 7919 + zlib.crc32(name.encode())
                    ),
                )
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                # Per-head norms initialised to ones would hide a weight applied wrongly.
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
            elif arch == "gemma3_text" and name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + weight) from zeros: random, each its own, so a
                # norm applied in the wrong place or without its offset shows.
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.uniform_(-0.5, 0.5, generator=generator)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def as_bin_checkpoint(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` with its weights as pytorch_model.bin instead of safetensors."""
    from safetensors.torch import load_file

    out.mkdir()
    for src in model_dir.iterdir():
        if src.suffix != ".safetensors":
            shutil.copy2(src, out / src.name)
    torch.save(load_file(model_dir / "model.safetensors"), out / "pytorch_model.bin")
    return out
