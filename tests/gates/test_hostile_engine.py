"""The gate against engines that answer what is not a measurement (gates/measure/openai_answers.py,
gates/measure/divergence.py, gates/measure/served.py): every number an engine hands the gate is
checked where it enters, what fails the check is named as not measured and fails the gate, a
server serving another model is never gated as the candidate, and a started engine ends with
the gate however the gate ends."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kiln.gates.decide.checks import threshold_check
from kiln.gates.decide.compare import Comparisons, PerplexityComparison
from kiln.gates.decide.rules import default_policy
from kiln.gates.decide.verdict import build_verdict
from kiln.gates.measure.divergence import kl_dense, kl_topk
from kiln.gates.measure.http_lm import HttpLM, NotMeasured
from kiln.gates.measure.openai_answers import logprob
from kiln.gates.measure.served import Capabilities, Served, parse_engine, settings_for
from kiln.gates.measure.sides import resolve_side
from kiln.gates.releases import Registry
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from kiln.runtime.base.errors import UsageError, VerdictFailure
from kiln.runtime.formats import artifact
from tests.gates.test_engine_gate import _serving

Answer = Callable[[dict[str, Any]], Any]  # a request body -> the JSON to answer it with

GATES: dict[str, Any] = {
    "tasks": ["kiln_ppl", "kiln_mc"],
    "limit": 4,
    "divergence": {"num_texts": 1, "max_seq_len": 24, "top_k": 5},
    "noise_floor": "off",
}


class AnsweringStub:
    """A real HTTP server on 127.0.0.1 whose /v1/completions answers whatever `answer` makes
    of the request (written with Python's json, so Infinity and NaN go out as JS literals)
    and whose /v1/models lists `models`."""

    def __init__(self, answer: Answer, models: list[dict[str, Any]]) -> None:
        self.answer, self.models = answer, models
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, data: Any) -> None:
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": stub.models})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(stub.answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Callable[..., AnsweringStub]]:
    started: list[AnsweringStub] = []

    def start(answer: Answer, models: list[dict[str, Any]] | None = None) -> AnsweringStub:
        started.append(AnsweringStub(answer, models or [{"id": "stub"}]))
        return started[-1]

    yield start
    for one in started:
        one.close()


def _prompts(body: dict[str, Any]) -> list[list[int]]:
    prompt = body["prompt"]
    return prompt if prompt and isinstance(prompt[0], list) else [prompt]


def answer_every_logprob(value: Any) -> Answer:
    """A vLLM-shaped answer whose every prompt log-probability is `value`."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, ids in enumerate(_prompts(body)):
            rows = [None] + [{str(t): {"logprob": value, "rank": 1}} for t in ids[1:]]
            choices.append({"index": i, "text": " the", "prompt_logprobs": rows})
        return {"model": body["model"], "choices": choices}

    return answer


def _hostile(kind: str) -> Answer:
    """Answers that parse as JSON but are not log-probabilities of the prompts asked."""
    if kind in ("Infinity", "positive", "string", "NaN"):
        value = {"Infinity": math.inf, "positive": 0.5, "string": "-0.1", "NaN": math.nan}[kind]
        return answer_every_logprob(value)
    good = answer_every_logprob(-0.25)

    def answer(body: dict[str, Any]) -> Any:
        data = good(body)
        if kind == "list-for-dict":
            for c in data["choices"]:
                c["prompt_logprobs"] = [None] + [[r] for r in c["prompt_logprobs"][1:]]
        elif kind == "word-keys":
            for c in data["choices"]:
                c["prompt_logprobs"] = [None] + [
                    {"tok": v} for r in c["prompt_logprobs"][1:] for v in r.values()
                ]
        elif kind == "fewer-choices":
            data["choices"] = data["choices"][:-1] or [{"index": 5, "text": ""}]
        elif kind == "mass-above-one":
            for c in data["choices"]:
                for r in c["prompt_logprobs"][1:]:
                    r.update({str(j): {"logprob": -0.01, "rank": 1} for j in range(1, 4)})
        return data

    return answer


HOSTILE = ["Infinity", "positive", "string", "NaN", "list-for-dict", "word-keys",
           "fewer-choices", "mass-above-one"]  # fmt: skip


@pytest.mark.parametrize("kind", HOSTILE)
def test_answers_that_are_not_log_probabilities_fail_the_gate_as_not_measured(
    kind: str, noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    engine = stub(_hostile(kind))
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "stub"}, "test")
    with Registry(tmp_path / "r.db") as registry:
        outcome = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out",
                           registry=registry)  # fmt: skip
        verdict = outcome.verdict
        assert not verdict.passed
        # Nothing the engine said was scored: every model check is named as not measured there.
        assert {c.name for c in verdict.failed_checks} == {
            "kiln_ppl: not measured", "kiln_mc: not measured", "KL divergence: not measured"
        }  # fmt: skip
        assert all(c.detail.startswith(f"on {engine.url} unknown: ")
                   for c in verdict.failed_checks)  # fmt: skip
        assert verdict.tasks == [] and verdict.perplexity == [] and verdict.divergence is None
        with pytest.raises(VerdictFailure, match="its gate runs against its float source failed"):
            registry.promote(noisy_artifact, "prod")


def test_an_infinite_log_probability_is_named_with_the_item(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    engine = stub(_hostile("Infinity"))
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "stub"}, "test")
    verdict = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out").verdict
    detail = next(c.detail for c in verdict.checks if c.name == "kiln_mc: not measured")
    assert "is inf, not a log-probability (finite, at most 0," in detail
    assert "-token prompt starting" in detail  # which item it was


def test_a_server_serving_another_model_is_not_gated_as_the_candidate(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    engine = stub(answer_every_logprob(-0.5), models=[{"id": "llama-3-70b", "root": "/m/x"}])
    gates = load_gates({**GATES, "engine": engine.url}, "test")
    with pytest.raises(UsageError, match=r"serves 'llama-3-70b', none of which is the candidate"):
        run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out")
    with pytest.raises(UsageError, match=r"--engine-model nope: .* serves 'llama-3-70b'"):
        run_gate(str(noisy_artifact), str(tiny_llama),
                 load_gates({**GATES, "engine": engine.url, "engine_model": "nope"}, "t"),
                 tmp_path / "out")  # fmt: skip


@pytest.mark.parametrize("length", [-5, 0, 3, "4096", 1.5])
def test_a_card_stating_no_usable_context_is_named_before_any_request(
    length: Any, noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    engine = stub(answer_every_logprob(-0.5), models=[{"id": "cand", "max_model_len": length}])
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "cand"}, "test")
    with pytest.raises(UsageError, match=r"states max_model_len .* not a context of at least 16"):
        run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out")


def test_a_model_named_by_the_user_is_recorded_as_named_not_checked(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    engine = stub(answer_every_logprob(-0.5), models=[{"id": "prod-llm"}])
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "prod-llm"}, "test")
    verdict = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out").verdict
    assert verdict.engines["candidate"]["identity"].startswith("named by --engine-model prod-llm")
    assert any("kiln did not check that it serves" in n for n in verdict.notes)


def test_a_card_naming_the_artifacts_digest_confirms_the_served_model(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    digest = resolve_side(str(noisy_artifact)).digest
    card = {"id": "/srv/models/model", "root": f"/srv/noisy-{digest[:12]}/model"}
    engine = stub(answer_every_logprob(-0.5), models=[{"id": "other"}, card])
    gates = load_gates({**GATES, "engine": engine.url + "/v1/"}, "test")  # the client's habit
    verdict = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out").verdict
    served = verdict.engines["candidate"]
    assert served["model"] == "/srv/models/model" and served["url"] == engine.url
    assert served["identity"] == f"its /v1/models card names the candidate's digest {digest[:12]}"


def test_an_answer_from_another_model_than_asked_is_not_measured(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    good = answer_every_logprob(-0.5)
    engine = stub(lambda body: {**good(body), "model": "a-cheaper-model"})
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "stub"}, "test")
    verdict = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out").verdict
    assert not verdict.passed
    assert "names model 'a-cheaper-model', not 'stub'" in " ".join(
        c.detail for c in verdict.failed_checks
    )


# --- the scorer fed arbitrary JSON ----------------------------------------------------------

PROMPT = [1, 17, 5, 42, 9]
VOCAB = 64

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats() | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)
_number = st.floats() | st.integers(-3, 3) | st.booleans() | st.text(max_size=3) | st.none()
_key = st.sampled_from([*map(str, PROMPT), "3", "63", "64", "-1", "07", "x", ""]) | st.text(
    max_size=2
)
_entry = st.dictionaries(
    _key,
    st.fixed_dictionaries({"logprob": _number}, optional={"rank": _number}) | _json,
    max_size=4,
)
_rows = st.lists(st.none() | _entry | _json, min_size=len(PROMPT) - 1, max_size=len(PROMPT) + 1)
_echo = st.fixed_dictionaries(
    {"token_logprobs": st.lists(_number, max_size=7)},
    optional={"top_logprobs": st.lists(st.none() | st.dictionaries(st.text(max_size=2), _number,
                                                                   max_size=3), max_size=7)},
)  # fmt: skip
_choice = st.fixed_dictionaries(
    {"index": st.sampled_from([0, 0, 0, 1, "0", None, True])},
    optional={"prompt_logprobs": _rows, "logprobs": _echo | _json, "text": _json},
)
ANSWERS = _json | st.fixed_dictionaries(
    {"choices": st.lists(_choice, min_size=0, max_size=2)},
    optional={"model": st.sampled_from(["stub", "other", None])},
)


def _valid_logprob(value: float) -> bool:
    return math.isfinite(value) and value <= 0.0


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_llama))


@pytest.fixture(scope="module")
def answering() -> Iterator[AnsweringStub]:
    """One server for every example: each sets what it answers."""
    engine = AnsweringStub(lambda body: None, [{"id": "stub"}])
    yield engine
    engine.close()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(answer=ANSWERS, echo=st.booleans())
def test_the_scorer_gives_log_probabilities_or_names_the_fault_never_anything_else(
    answer: Any, echo: bool, tiny_tokenizer: Any, answering: AnsweringStub
) -> None:
    """Whatever JSON a server answers, the scorer returns log-probabilities (finite, at most
    0), a KL that is finite and not negative, or NotMeasured naming the fault; never an
    internal error, never a number that is not a log-probability."""
    engine = answering
    engine.answer = lambda body: answer
    caps = Capabilities(prompt_logprobs=not echo, echo_logprobs=True)
    served = Served("url", engine.url, "stub", "1", None, {}, None, 64, caps)
    lm = HttpLM(served, tiny_tokenizer, max_length=32, concurrency=1, vocab_size=VOCAB)
    try:
        scores = lm._loglikelihood_tokens([(None, PROMPT[:2], PROMPT[2:])])
        assert all(_valid_logprob(total) for total, _ in scores)
        if not echo:
            top = lm.topk_logprobs([PROMPT], 3)[0]
            assert all(_valid_logprob(v) for row in top for v in row.values())
            kl, _ = kl_topk([{PROMPT[i + 1]: -0.1, 3: -3.0} for i in range(len(top))], top)
            assert np.all(np.isfinite(kl)) and np.all(kl >= 0.0)
    except NotMeasured as exc:
        assert exc.reason
    finally:
        lm.close()


def test_an_engine_that_stops_answering_costs_one_timeout_not_one_per_request(
    tiny_tokenizer: Any, stub
) -> None:
    good = answer_every_logprob(-0.5)

    def stalls(body: dict[str, Any]) -> Any:
        time.sleep(2.0)
        return good(body)

    engine = stub(stalls)
    caps = Capabilities(prompt_logprobs=True, echo_logprobs=True)
    served = Served("url", engine.url, "stub", "1", None, {}, None, 64, caps)
    lm = HttpLM(served, tiny_tokenizer, max_length=32, batch_size=1, concurrency=1,
                vocab_size=VOCAB, timeout_s=0.5)  # fmt: skip
    started = time.monotonic()
    try:
        with pytest.raises(
            NotMeasured, match=r"stopped answering: a request got no answer in 0\.5 s"
        ):
            lm._loglikelihood_tokens([(None, PROMPT[:2], PROMPT[2:])] * 6)
        with pytest.raises(NotMeasured, match="so kiln asked it nothing more"):
            lm.topk_logprobs([PROMPT] * 6, 3)
    finally:
        lm.close()
    assert time.monotonic() - started < 5.0  # one timeout (0.5 s), not twelve


# --- the divergence and the checks ------------------------------------------------------------


def test_top_k_sets_that_share_no_token_are_a_divergence_not_agreement() -> None:
    p = [{1: math.log(0.6), 2: math.log(0.3)}]
    q = [{7: math.log(0.6), 8: math.log(0.3)}]
    kl, agree = kl_topk(p, q)
    # P puts 0.9 on tokens Q gives at most 0.3 each: at least 0.9 log(0.9/0.6) + 0.1 log(0.1/0.4)
    assert kl[0] >= 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4) - 1e-12
    assert not agree[0]


def test_mass_q_lists_elsewhere_is_not_lent_to_tokens_it_leaves_out() -> None:
    """Q lists 0.95 of its mass (0.35 on P's top token, 0.6 on one P barely holds), so P's
    second token gets at most 0.05 from Q, however large Q's smallest listed probability."""
    p = [{1: math.log(0.5), 2: math.log(0.4)}]
    q = [{3: math.log(0.6), 1: math.log(0.35)}]
    kl, _ = kl_topk(p, q)
    least = 0.5 * math.log(0.5 / 0.35) + 0.4 * math.log(0.4 / 0.05) + 0.1 * math.log(0.1 / 0.6)
    assert kl[0] >= least - 1e-9
    # and it is still a lower bound: one full Q consistent with that top-2
    full_p = {1: 0.5, 2: 0.4, 4: 0.1}
    full_q = {1: 0.35, 3: 0.6, 2: 0.04, 4: 0.01}
    true = sum(v * math.log(v / full_q[t]) for t, v in full_p.items())
    assert kl[0] <= true + 1e-9


@pytest.mark.parametrize("value", [-(10**400), -1e5, -1e300])
def test_a_number_no_model_gives_is_not_a_log_probability(value: Any) -> None:
    with pytest.raises(NotMeasured, match="not a log-probability"):
        logprob(value, "position 3")


def test_an_engine_whose_scores_and_top_k_disagree_measures_nothing(
    noisy_artifact: Path, tiny_llama: Path, tmp_path: Path, stub
) -> None:
    """An engine that scores the tasks one way and answers top-k requests (the divergence)
    as a model certain of every token: neither is trusted."""
    scores, certain = answer_every_logprob(-0.5), answer_every_logprob(-0.001)
    engine = stub(lambda body: (certain if body.get("prompt_logprobs") else scores)(body))
    gates = load_gates({**GATES, "engine": engine.url, "engine_model": "stub"}, "test")
    verdict = run_gate(str(noisy_artifact), str(tiny_llama), gates, tmp_path / "out").verdict
    assert not verdict.passed
    assert {c.name for c in verdict.failed_checks} == {
        "kiln_ppl: not measured", "kiln_mc: not measured", "KL divergence: not measured"
    }  # fmt: skip
    assert all("its scores are not one model's" in c.detail for c in verdict.failed_checks)


@pytest.mark.parametrize(
    ("side", "row", "why"),
    [
        ("candidate", {1: math.inf}, "not a log-probability"),
        ("candidate", {1: math.nan}, "not a log-probability"),
        ("baseline", {1: 0.3}, "not a log-probability"),
        ("candidate", {1: -0.01, 2: -0.02}, "sum to"),
        ("candidate", {}, "gave no log-probabilities"),
    ],
)
def test_numbers_that_are_not_a_distribution_are_no_divergence(side: str, row, why: str) -> None:
    good = {1: math.log(0.5), 2: math.log(0.25)}
    p, q = (row, good) if side == "baseline" else (good, row)
    with pytest.raises(NotMeasured, match=why) as raised:
        kl_topk([good, p], [good, q])
    assert f"the {side}" in raised.value.reason and "position 1" in raised.value.reason


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 12),
    spread=st.floats(0.1, 6.0),
    shift=st.floats(0.0, 3.0),
)
def test_the_top_k_divergence_never_exceeds_the_true_one(
    seed: int, k: int, spread: float, shift: float
) -> None:
    rng = np.random.default_rng(seed)
    logits_p = rng.normal(size=(4, 40)) * spread
    logits_q = logits_p + rng.normal(size=(4, 40)) * shift
    dense, _ = kl_dense(logits_p, logits_q)
    log_p = logits_p - np.log(np.exp(logits_p).sum(-1, keepdims=True))
    log_q = logits_q - np.log(np.exp(logits_q).sum(-1, keepdims=True))

    def top(log: np.ndarray) -> list[dict[int, float]]:
        return [{int(t): float(row[t]) for t in np.argsort(-row)[:k]} for row in log]

    bound, _ = kl_topk(top(log_p), top(log_q))
    assert np.all(bound <= dense + 1e-9)


def test_a_value_that_is_not_finite_never_passes_a_check() -> None:
    for value in (math.inf, -math.inf, math.nan):
        assert not threshold_check("KL", value, "<=", 0.1).passed
        assert not threshold_check("top-1", value, ">=", 0.5).passed


@pytest.mark.parametrize(("baseline", "candidate"), [(12.0, 0.0), (12.0, 0.5), (math.inf, 9.0)])
def test_a_perplexity_below_one_or_infinite_is_not_measured(baseline, candidate) -> None:
    compared = Comparisons(perplexity=[PerplexityComparison("ppl", "word_perplexity", baseline,
                                                            candidate)])  # fmt: skip
    verdict = build_verdict({}, {}, default_policy(8), compared)
    assert not verdict.passed
    (check,) = verdict.checks
    assert check.outcome == "not measured" and "not a word_perplexity" in check.detail


# --- the engine a gate started ------------------------------------------------------------------

_GATE_THEN_WAIT = """
import sys, time
from pathlib import Path
from kiln.gates.measure.served import EngineChoice, serve_side, settings_for
from kiln.gates.measure.sides import resolve_side
side = resolve_side(sys.argv[1])
settings = settings_for(side, None, 5)
with serve_side(EngineChoice("kiln-serve"), side, settings, Path(sys.argv[2]), "candidate",
                [1]) as served:
    print(served.url, served.max_model_len, settings.max_model_len, flush=True)
    time.sleep(600)
"""


def _long_context_artifact(model_dir: Path, root: Path) -> Path:
    """An artifact whose recipe keeps the 4096-token default beyond the model's positions."""
    recipe = {"name": "long", "quantization": {"method": "none", "weight_bits": 16},
              "deploy": {"max_seq_len": 4096}}  # fmt: skip
    with artifact.assemble(root, artifact.Manifest(name="long", recipe=recipe)) as staging:
        import shutil

        shutil.copytree(model_dir, staging.dir / "model")
    assert staging.path is not None
    return staging.path


def test_an_engine_serves_the_models_context_and_dies_with_a_killed_gate(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """`kill -9` of the gate runs none of its cleanup: the engine's watch ends it anyway. The
    engine serves the recipe's default context clamped to the model's, rather than refusing."""
    art = _long_context_artifact(tiny_llama, tmp_path / "arts")
    model_len = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    gate = subprocess.Popen([sys.executable, "-c", _GATE_THEN_WAIT, str(art), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert gate.stdout is not None
        url, served_len, asked = gate.stdout.readline().split()
        assert int(served_len) == int(asked) == model_len < 4096
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert _serving(art) != []
    finally:
        os.kill(gate.pid, signal.SIGKILL)
        gate.wait()
    deadline = time.monotonic() + 60
    while _serving(art) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _serving(art) == []
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_an_engine_url_is_taken_with_or_without_v1() -> None:
    for spelled in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert parse_engine(spelled).url == "http://h:8000"
    with pytest.raises(UsageError, match="names the model of a running server"):
        parse_engine("kiln-serve", model="x")


def test_settings_for_a_side_without_a_recipe_context_leave_the_engine_its_own(
    noisy_artifact: Path,
) -> None:
    assert settings_for(resolve_side(str(noisy_artifact)), None, 5).max_model_len is None
