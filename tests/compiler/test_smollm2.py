"""The real embedded model through the whole compile: slow, but what `make demo` promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.runtime.formats import artifact


@pytest.mark.slow(minutes=2.5)  # the GPTQ compile in its fixture
def test_gptq_w4a16_keeps_smollm2_perplexity_within_20_percent(
    smollm2_gptq_artifact: Path,
) -> None:
    manifest = artifact.load_manifest(smollm2_gptq_artifact)
    assert manifest.scheme.scheme == "W4A16_GPTQ"
    assert manifest.scheme.group_size == 64
    assert artifact.verify(smollm2_gptq_artifact) == []
    report = json.loads((smollm2_gptq_artifact / artifact.QUANT_REPORT).read_text())
    # Seen on this machine: fp32 27.0 → GPTQ-W4 g64 31.1 on held-out text.
    assert report["perplexity_quantized"] <= 1.2 * report["perplexity_float"]
    assert report["top1_agreement"] > 0.7
    # 4-bit linears: the checkpoint is well under half of the float32 model (embeddings stay).
    model_bytes = sum(e.size for p, e in manifest.files.items() if p.startswith("model/"))
    assert model_bytes < 0.45 * manifest.source.parameters * 4
    assert manifest.targets["h100-sxm"].engine == "planned"
    # GPTQ int4 in compressed-tensors: served on TensorRT-LLM's PyTorch backend from its
    # exact ModelOpt HF conversion, which keeps the two float down_proj layers float.
    assert manifest.targets["l40s"].pytorch == "ready"
    quant = json.loads((smollm2_gptq_artifact / "trtllm/hf/hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert "model.layers.11.mlp.down_proj" in quant["quantization"]["exclude_modules"]
