"""The `gates:` section and the offline task files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.gates.measure.tasks import (
    BUILTIN_TASKS_DIR,
    PLACEHOLDER,
    local_task_names,
    prepare_task_dir,
)
from kiln.gates.settings import load_gate_file, load_gates
from kiln.runtime.base.errors import UsageError


def test_defaults_follow_the_scheme_and_overrides_apply() -> None:
    gates = load_gates({"thresholds": {"flip_rate": 0.1, "shadow_exact_match": "off"}}, "r.yaml")
    four, eight = gates.policy(4), gates.policy(8)
    assert four.recovery_min == 0.97 and eight.recovery_min == 0.99
    assert four.flip_rate_max == eight.flip_rate_max == 0.1
    assert eight.shadow_exact_match_min is None  # "off": reported, not gated
    assert eight.rule == "mcnemar" and eight.inconclusive == "pass"
    assert load_gates({"thresholds": {"recovery": None}}, "r").policy(8).recovery_min == 0.99
    # a dumped section (as the resolved recipe in a manifest holds it) means the same
    again = load_gates(gates.model_dump(mode="json"), "manifest").policy(8)
    assert again == eight


def test_unknown_keys_and_bad_values_are_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as err:
        load_gates({"decision_rule": "vibes", "shadow": {"trafic": "x"}}, "r.yaml")
    message = err.value.message
    assert "r.yaml: gates.decision_rule" in message and "recovery_or_noninferior" in message
    assert "r.yaml: gates.shadow.trafic: Extra inputs are not permitted" in message
    plain = tmp_path / "g.yaml"
    plain.write_text("limit: 5\nthresholds: {recovery: 0.95}\n")  # a bare section works too
    assert load_gate_file(plain).policy(8).recovery_min == 0.95
    with pytest.raises(UsageError, match="not found"):
        load_gate_file(tmp_path / "missing.yaml")


def test_task_files_resolve_their_data_directory(tmp_path: Path) -> None:
    """The built-in tasks read their data beside kiln_data.py (copied, its data linked); a
    user's task file that names `${KILN_TASKS_DIR}` gets its own directory's path."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {PLACEHOLDER}/mine.jsonl\n"
    )
    out = prepare_task_dir([BUILTIN_TASKS_DIR, user], tmp_path / "tasks")
    assert local_task_names(out) == {
        "kiln_ppl", "kiln_mc", "kiln_qa", "kiln_cloze", "kiln_next_word", "mine"
    }  # fmt: skip
    assert PLACEHOLDER not in (out / "mine.yaml").read_text()
    assert str(user.resolve()) in (out / "mine.yaml").read_text()
    assert (out / "kiln_data.py").is_file() and (out / "kiln_mc.jsonl").resolve() == (
        BUILTIN_TASKS_DIR / "kiln_mc.jsonl"
    ).resolve()


def test_task_data_is_well_formed_and_small() -> None:
    total = 0
    for name, key in (("kiln_mc", "choices"), ("kiln_qa", "answers"), ("kiln_ppl", "text")):
        path = BUILTIN_TASKS_DIR / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len({r["id"] for r in rows}) == len(rows) and all(r[key] for r in rows)
        total += path.stat().st_size
    mc = [json.loads(line) for line in (BUILTIN_TASKS_DIR / "kiln_mc.jsonl").open()]
    assert all(len(r["choices"]) == 4 and 0 <= r["answer"] < 4 for r in mc)
    assert total < 300_000


def test_unknown_tasks_are_a_usage_error() -> None:
    from kiln.gates.measure.tasks import run_tasks

    with pytest.raises(UsageError, match=r"unknown task.*kiln_nope"):
        run_tasks(object(), ["kiln_mc", "kiln_nope"])


def test_an_unquoted_off_turns_a_check_off_and_never_becomes_zero(tmp_path: Path) -> None:
    path = tmp_path / "gate.yaml"
    # YAML 1.1 reads `off` as false, which would otherwise validate as a threshold of 0.0
    path.write_text("thresholds: {flip_rate: off, kl_mean: off}\n")
    policy = load_gate_file(path).policy(8)
    assert policy.flip_rate_max is None and policy.kl_mean_max is None
    path.write_text("thresholds: {kl_mean: on}\n")
    with pytest.raises(UsageError, match=r"gates\.thresholds\.kl_mean: .*YAML boolean"):
        load_gate_file(path)
    path.write_text("thresholds: {margin: off}\n")
    with pytest.raises(UsageError, match=r"gates\.thresholds\.margin: .*YAML boolean"):
        load_gate_file(path)
    path.write_text("baseline: off\n")
    with pytest.raises(UsageError, match=r"gates\.baseline: .*unquoted on/off.*quote it"):
        load_gate_file(path)


def test_the_cloze_tasks_have_the_items_to_detect_a_two_point_loss() -> None:
    from kiln.gates.decide.mcnemar import min_detectable_loss

    rows = [json.loads(line) for line in (BUILTIN_TASKS_DIR / "kiln_cloze.jsonl").open()]
    assert len(rows) >= 1000 and len({r["id"] for r in rows}) == len(rows)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"shakespeare", "python-docs"}  # no arithmetic mixed in
    for r in rows:
        assert len(set(r["choices"])) == 4 and r["choices"][r["answer"]] == r["target"]
        assert 16 <= len(r["context"].split()) <= 32
    # at the 8% flips 8-bit schemes show on greedy generation: under 2.5 points
    assert min_detectable_loss(len(rows), 0.08) < 0.025


def test_default_tasks_have_a_thousand_items_each_one_kind_of_scoring_each() -> None:
    gates = load_gates({}, "r.yaml")
    kinds = {}
    for name in gates.tasks:
        (path,) = [
            p for p in BUILTIN_TASKS_DIR.glob("*.yaml") if f"task: {name}\n" in p.read_text()
        ]
        text = path.read_text()
        kinds[name] = text.split("output_type: ", 1)[1].split()[0]
        data = text.split("data_file: ", 1)[1].split()[0]
        rows = (BUILTIN_TASKS_DIR / data).read_text().splitlines()
        if kinds[name] != "loglikelihood_rolling":  # perplexity is scored by token, not item
            assert len(rows) >= 1000, (name, len(rows))
    assert sorted(kinds.values()) == ["generate_until", "loglikelihood_rolling", "multiple_choice"]


def test_a_threshold_written_with_an_exponent_is_a_number(tmp_path: Path) -> None:
    """YAML 1.1 reads `1e-3` as a string; a gate file reads it as every other tool does."""
    path = tmp_path / "gate.yaml"
    path.write_text("thresholds: {kl_mean: 1e-3, kl_p99: 2.5E-2}\n")
    policy = load_gate_file(path).policy(8)
    assert policy.kl_mean_max == 0.001 and policy.kl_p99_max == 0.025
