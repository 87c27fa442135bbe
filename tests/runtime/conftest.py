"""Helpers for runtime tests: a transformers reference and a few fixed prompts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.runtime import Logprob
from kiln.runtime.engine import native

# Tests of kiln's AVX2 kernels (bf16 weights, int4 weights): skipped where they cannot load.
needs_avx2_kernels = pytest.mark.skipif(
    not native.avx2_kernels_available(),
    reason="kiln's AVX2 kernels need an x86 CPU with AVX2 and FMA, and a C++ compiler",
)
# Tests of kiln's AVX512-BF16 linear kernel: skipped where the CPU lacks the instruction.
needs_dpbf16_kernels = pytest.mark.skipif(
    not native.dpbf16_kernels_available(),
    reason="kiln's AVX512-BF16 kernel needs a CPU with AVX512-BF16, and a C++ compiler",
)
# Tests of kiln's AMX kernels (bf16 linear, prefill attention): skipped where they cannot run.
needs_amx_kernels = pytest.mark.skipif(
    not native.amx_kernels_available(),
    reason="kiln's AMX kernels need a CPU with AMX-BF16 (and an OS that grants the tile unit)",
)

PROMPTS = [
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "This program is free software; you can redistribute it",
    "THE SOFTWARE IS PROVIDED AS IS, WITHOUT WARRANTY OF ANY KIND",
    "Licensed under the Apache License",
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # Two shared cores: one thread keeps tests fast and results independent of load.
    torch.set_num_threads(1)


def logprobs_of(entries: list[dict[int, Logprob] | None], tokens: list[int]) -> torch.Tensor:
    """The log-probability each entry gives its token, as a tensor."""
    values = []
    for entry, token in zip(entries, tokens, strict=True):
        assert entry is not None
        values.append(entry[token].logprob)
    return torch.tensor(values)


def hf_model(model_dir: Path) -> Any:
    """The transformers reference for a checkpoint directory, in float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompt_ids(model_dir: Path, count: int = len(PROMPTS)) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(text) for text in PROMPTS[:count]]


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model: Any, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the reference's logits at every position, [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def assert_close_to_reference(
    engine: Any, reference: Any, max_tol: float, mean_tol: float, tokens: int = 16
) -> tuple[list[int], list[int]]:
    """Prompt log-probabilities of `engine` within (max, mean) |delta| of a transformers
    `reference`, and each greedy token the reference's choice or within max_tol of it (a
    near-tie that rounding may flip), judged with the reference teacher-forced on ours.
    Returns (prompt, generated token ids)."""
    from kiln.runtime import SamplingParams

    prompt = engine.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = engine.generate([prompt], params)[0]
    assert out.prompt_logprobs is not None
    ours = logprobs_of(out.prompt_logprobs[1:], prompt[1:])
    theirs = hf_logprobs(reference, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    delta = (ours - theirs).abs()
    assert delta.max() <= max_tol and delta.mean() <= mean_tol, (delta.max(), delta.mean())
    continued = hf_logprobs(reference, prompt + out.token_ids)[len(prompt) - 1 : -1]
    chosen = continued[torch.arange(tokens), torch.tensor(out.token_ids)]
    assert (continued.max(dim=-1).values - chosen).max() <= max_tol
    return prompt, out.token_ids


KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KV_INT8 = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}


def group_scheme(bits: int, group: int, symmetric: bool) -> dict[str, object]:
    weights = {"num_bits": bits, "type": "int", "strategy": "group", "group_size": group}
    return {"g": {"targets": ["Linear"], "weights": {**weights, "symmetric": symmetric}}}


def recipe(mode: str) -> tuple[list[Any], bool]:
    """The llm-compressor modifiers for a mode, and whether it needs calibration data."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = ["lm_head"]
    if mode == "w4a16_gptq_sym":
        return [GPTQModifier(ignore=ignore, config_groups=group_scheme(4, 32, True))], True
    if mode == "w4a16_asym":
        return [
            QuantizationModifier(ignore=ignore, config_groups=group_scheme(4, 64, False))
        ], False
    if mode == "w8a16":
        return [QuantizationModifier(targets="Linear", ignore=ignore, scheme="W8A16")], False
    if mode == "w8a8_int8":
        return [GPTQModifier(targets="Linear", ignore=ignore, scheme="W8A8")], True
    if mode == "w8a8_int8_kv_int8":
        modifier = QuantizationModifier(
            targets="Linear", ignore=ignore, scheme="W8A8", kv_cache_scheme=KV_INT8
        )
        return [modifier], True
    if mode == "fp8_dynamic":
        return [QuantizationModifier(targets="Linear", ignore=ignore, scheme="FP8_DYNAMIC")], False
    if mode == "fp8_static_kv_fp8":
        modifier = QuantizationModifier(
            targets="Linear", ignore=ignore, scheme="FP8", kv_cache_scheme=KV_FP8
        )
        return [modifier], True
    raise AssertionError(mode)


@pytest.fixture(scope="session")
def quantized(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build (once per mode) a compressed-tensors checkpoint of tiny_llama with llm-compressor."""
    return quantizer(tiny_llama, tmp_path_factory)


@pytest.fixture(scope="session")
def quantized_qwen3(
    tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The same modes on tiny_qwen3 (per-head q/k norms, heads of 64)."""
    return quantizer(tiny_qwen3, tmp_path_factory)


@pytest.fixture(scope="session")
def quantized_phi3(
    tiny_phi3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The same modes on tiny_phi3 (fused qkv_proj and gate_up_proj)."""
    return quantizer(tiny_phi3, tmp_path_factory)


@pytest.fixture(scope="session")
def quantized_gemma3(
    tiny_gemma3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The same modes on tiny_gemma3 (offset norms, sliding-window layers, tanh GELU)."""
    return quantizer(tiny_gemma3, tmp_path_factory)


@pytest.fixture(scope="session")
def quantized_qwen3_moe(
    tiny_qwen3_moe: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The same modes on tiny_qwen3_moe (4 experts, 2 per token; layer 1 dense)."""
    return quantizer(tiny_qwen3_moe, tmp_path_factory)


def quantizer(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """mode → a compressed-tensors checkpoint of `source` made by llm-compressor (once)."""
    pytest.importorskip("llmcompressor")
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = tokenizer.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
    samples = [ids[i * 64 : (i + 1) * 64] for i in range(16)]
    data = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * 64] * 16})
    built: dict[str, Path] = {}

    def build(mode: str) -> Path:
        if mode not in built:
            modifiers, calibrate = recipe(mode)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            extra = {
                "dataset": data,
                "num_calibration_samples": 16,
                "max_seq_length": 64,
                "shuffle_calibration_samples": False,
            }
            torch.manual_seed(0)
            oneshot(model=model, recipe=modifiers, **(extra if calibrate else {}))
            out = tmp_path_factory.mktemp(f"{source.name}-{mode}")
            model.save_pretrained(out, save_compressed=True)
            tokenizer.save_pretrained(out)
            built[mode] = out
        return built[mode]

    return build
