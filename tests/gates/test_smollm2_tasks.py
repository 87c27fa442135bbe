"""The offline tasks discriminate: SmolLM2-135M-Instruct, through kiln's runtime, scores
clearly above chance on them (slow: it loads and runs the real 135M model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.gates.measure.lm_eval_adapter import KilnLM
from kiln.gates.measure.tasks import run_tasks


@pytest.mark.slow(minutes=0.5)
def test_smollm2_scores_clearly_above_chance(smollm2_float: Path) -> None:
    torch.set_num_threads(2)
    results = run_tasks(KilnLM(pretrained=str(smollm2_float)), ["kiln_mc", "kiln_qa", "kiln_ppl"])
    mc, qa, ppl = results["kiln_mc"], results["kiln_qa"], results["kiln_ppl"]
    assert len(mc.per_item) == 144 and len(qa.per_item) == 139
    # chance is 0.25 with 4 choices and ~0 for free-form answers; measured: 0.67 and 0.55
    assert mc.value > 0.55
    assert qa.value > 0.40
    assert 10 < ppl.value < 80  # measured 39.9 word perplexity on our prose
