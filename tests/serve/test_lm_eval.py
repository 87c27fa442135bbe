"""lm-eval's `local-completions` client scores a loglikelihood task against the live server,
item for item like the in-process runtime model (`kiln`) on the same engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.gates.measure.lm_eval_adapter import KilnLM
from kiln.gates.measure.tasks import run_tasks
from tests.serve.conftest import MODEL, LiveServer, tiny_engine

pytest.importorskip("lm_eval")


def test_local_completions_loglikelihood_matches_the_runtime(
    shared_server: LiveServer, tiny_llama: Path
) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{shared_server.url}/v1/completions",
        model=MODEL,
        tokenizer=str(tiny_llama),
        tokenizer_backend="huggingface",
        max_length=120,
        num_concurrent=2,
        max_retries=1,
    )
    served = run_tasks(lm, ["kiln_mc"], limit=6)["kiln_mc"]
    # A second engine on the same weights: the served one is stepped by the server's thread.
    local_lm = KilnLM(engine=tiny_engine(tiny_llama), max_length=120)
    local = run_tasks(local_lm, ["kiln_mc"], limit=6)["kiln_mc"]
    assert len(served.per_item) == 6
    assert served.per_item == local.per_item
    assert served.metrics["acc"] == pytest.approx(local.metrics["acc"])
    assert served.metrics["acc_norm"] == pytest.approx(local.metrics["acc_norm"])
