"""llm-compressor's AWQ on a CPU-only machine: broken as released, working with our patch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llmcompressor import oneshot
from llmcompressor.pipelines.cache import IntermediatesCache
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.quant.backends.cpu_workarounds import llmcompressor_on_cpu
from kiln.quant.backends.llmcompressor import build_recipe
from kiln.quant.calibration import load_texts, tokenize
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from tests.quant.conftest import CALIBRATION

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="the patch is a no-op where an accelerator exists"
)
AWQ = QuantSpec(method="awq", weight_bits=4, group_size=64)


def _awq_oneshot(model_dir: Path) -> torch.nn.Module:
    from datasets import Dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenize(load_texts(CALIBRATION), tokenizer, CALIBRATION.max_seq_len)[:4]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]})
    oneshot(
        model=model,
        tokenizer=tokenizer,
        recipe=build_recipe(resolve(AWQ), AWQ),
        dataset=dataset,
        num_calibration_samples=len(ids),
    )
    return model


def test_awq_fails_on_cpu_without_the_patch(tiny_llama: Path) -> None:
    with pytest.raises(RuntimeError, match="Cannot access accelerator device"):
        _awq_oneshot(tiny_llama)


def test_awq_runs_on_cpu_with_the_patch(tiny_llama: Path) -> None:
    original = IntermediatesCache.pin_memory
    with llmcompressor_on_cpu():
        model = _awq_oneshot(tiny_llama)
    assert IntermediatesCache.pin_memory is original  # restored after the block
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.quantization_scheme.weights.num_bits == 4
