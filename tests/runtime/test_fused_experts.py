"""A mixture of experts saved as transformers 5 saves it (Mixtral's block under `mlp`, each
layer's experts fused into gate_up_proj and down_proj) serves as its per-expert original does:
kiln's checkpoint reader reads the per-expert names from the fused tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from tests.compiler.test_checkpoint_completeness import fused


def _prompt_logprobs(model_dir: Path) -> list[float]:
    engine = Engine.from_pretrained(model_dir, dtype="float32", max_model_len=64, num_threads=1)
    ids = [5, 17, 23, 42, 7, 11, 3, 29]
    out = engine.generate([ids], [SamplingParams(max_tokens=1, temperature=0.0,
                                                 prompt_logprobs=0)])[0]  # fmt: skip
    return [entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]


def test_a_mixtral_saved_fused_serves_as_its_per_expert_original(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    fused_dir = fused(tiny_mixtral, tmp_path / "fused", (4, 4))
    assert torch.equal(
        torch.tensor(_prompt_logprobs(fused_dir)), torch.tensor(_prompt_logprobs(tiny_mixtral))
    )
