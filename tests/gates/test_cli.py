"""The gate's commands and their exit codes: 0 pass, 1 verdict failure, 2 usage, 3 runtime."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from click.testing import CliRunner

from kiln.compiler.cli.gate import gate, promote, registry, rollback
from kiln.gates.releases import Registry
from kiln.runtime.formats.artifact import load_manifest
from kiln.runtime.formats.mirror_log import MirrorEntry, append_entry
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import COMPLETIONS
from tests.gates.conftest import (
    OpenAIStub,
    answers_with,
    baseline_responder,
    build_artifact,
    write_traffic,
)


def run(command: object, args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(command, args)  # type: ignore[arg-type]
    return result.exit_code, result.stdout, result.stderr


def test_a_passing_shadow_gate_exits_0_and_writes_reports(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    base, cand = openai_stub(baseline_responder), openai_stub(baseline_responder)
    traffic = write_traffic(tmp_path / "t.jsonl")
    db = tmp_path / "r.db"
    code, out, err = run(
        gate,
        [
            cand.url,
            "--baseline",
            base.url,
            "--traffic",
            str(traffic),
            "--output",
            str(tmp_path / "out"),
            "--registry",
            str(db),
        ],
    )
    assert code == 0, err
    assert "## kiln gate: PASS" in out and "recorded as gate run 1" in out
    data = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert data["passed"] and data["shadow"]["num_requests"] == 6
    assert data["notes"] == [
        "lm-eval tasks and KL divergence skipped: an endpoint side has no logprobs"
    ]
    assert (tmp_path / "out" / "gate.html").is_file()
    with Registry(db) as reg:
        assert reg.gate_runs()[0]["baseline"] == base.url


def test_a_failing_gate_exits_1_naming_the_failed_checks(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    base = openai_stub(baseline_responder)
    cand = openai_stub(answers_with({"Count: one two": "3 4 5", "Once upon a time": "no"}))
    code, out, err = run(
        gate,
        [
            cand.url,
            "--baseline",
            base.url,
            "--traffic",
            str(write_traffic(tmp_path / "t.jsonl")),
            "--output",
            str(tmp_path / "out"),
            "--no-record",
            "--json",
        ],
    )
    assert code == 1
    assert json.loads(out)["passed"] is False
    assert "gate failed" in err and "shadow: exact match" in err and "gate.html" in err


def test_usage_mistakes_exit_2(tmp_path: Path, openai_stub: Callable[..., OpenAIStub]) -> None:
    base = openai_stub(baseline_responder)
    code, _, err = run(gate, [base.url, "--baseline", str(tmp_path / "nowhere"), "--no-record"])
    assert code == 2 and "not a kiln artifact" in err and "nowhere" in err
    code, _, err = run(gate, [base.url, "--baseline", base.url, "--no-record"])
    assert code == 2 and "--traffic" in err
    bad = tmp_path / "gate.yaml"
    bad.write_text("gates:\n  thresholds:\n    recovry: 0.9\n")
    code, _, err = run(
        gate, [base.url, "--baseline", base.url, "--gate-file", str(bad), "--no-record"]
    )
    assert code == 2 and "gates.thresholds.recovry" in err and str(bad) in err
    code, _, _ = run(gate, [base.url])  # click: missing --baseline
    assert code == 2


def test_a_mirror_log_gate_writes_reports_and_records_like_any_gate(tmp_path: Path) -> None:
    log, db, out = tmp_path / "mirror.jsonl", tmp_path / "r.db", tmp_path / "out"
    for i, (primary, candidate) in enumerate([("4", "4"), ('{"a": 1}', '{"a": 1}')]):
        entry = MirrorEntry(f"m{i}", 0.0, COMPLETIONS, f"prompt {i} in JSON", {"max_tokens": 4},
                            SideAnswer(primary, [1]), SideAnswer(candidate, [1]))  # fmt: skip
        append_entry(log, entry)
    args = ["http://cand:1", "--baseline", "http://base:1", "--mirror-log", str(log)]
    code, out_text, err = run(gate, [*args, "--registry", str(db), "--output", str(out)])
    assert code == 0, err
    assert "## kiln gate: PASS" in out_text and "recorded as gate run 1" in out_text
    data = json.loads((out / "gate.json").read_text())
    assert data["shadow"]["num_requests"] == 2 and data["shadow"]["exact_match_rate"] == 1.0
    assert data["shadow"]["settings"] == {"mirror_log": str(log)}
    assert data["notes"][0].startswith(f"mirror log {log}: 2 mirrored requests")
    assert (out / "gate.html").is_file()
    with Registry(db) as reg:
        assert reg.gate_runs()[0]["baseline"] == "http://base:1"


def test_the_old_shadow_log_spelling_still_works_unlisted(tmp_path: Path) -> None:
    missing = tmp_path / "m.jsonl"
    args = ["http://127.0.0.1:9", "--baseline", "http://127.0.0.1:9", "--no-record"]
    code, _, err = run(gate, [*args, "--shadow-log", str(missing)])
    assert code == 2 and f"{missing}: mirror log not found" in err
    assert "shadow-log" not in run(gate, ["--help"])[1]


def test_a_damaged_candidate_artifact_exits_3(
    tmp_path: Path, openai_stub: Callable[..., OpenAIStub]
) -> None:
    art = build_artifact(tmp_path / "arts")
    (art / "manifest.json").write_text("{not json")
    base = openai_stub(baseline_responder)
    code, _, err = run(gate, [str(art), "--baseline", base.url, "--no-record"])
    assert code == 3 and "manifest.json" in err


def test_promote_and_rollback_commands(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    arts = [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(2)]
    code, _, err = run(promote, [str(arts[0]), "--channel", "prod", "--registry", db])
    assert code == 2 and f"kiln gate {arts[0]} --baseline" in err
    with Registry(db) as reg:
        reg.configure_channel("prod", "fixed", "f" * 64)
        for art in arts:
            digest = load_manifest(art).digest
            reg.record_gate_run(
                {
                    "passed": art == arts[0],
                    "candidate": {"digest": digest},
                    "baseline": {"digest": "f" * 64, "kind": "source"},
                },
                art,
            )
    code, out, err = run(
        promote, [str(arts[0]), "--channel", "prod", "--reason", "v0", "--registry", db]
    )
    assert code == 0, err
    code, _, err = run(promote, [str(arts[1]), "--channel", "prod", "--registry", db])
    assert code == 1 and "failed" in err
    code, out, _ = run(registry, ["ls", "--registry", db])
    assert "prod" in out and "m0" in out and "FAIL" in out
    code, _, err = run(rollback, ["prod", "--registry", db])
    assert code == 2 and "nothing to roll back to" in err
    code, out, _ = run(registry, ["history", "prod", "--registry", db])
    assert code == 0 and "promote" in out and "v0" in out


def test_a_gate_with_nothing_to_measure_exits_2(tmp_path: Path) -> None:
    art = build_artifact(tmp_path / "arts")
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    empty = tmp_path / "gate.yaml"
    empty.write_text("tasks: []\ndivergence: {enabled: false}\n")
    code, _, err = run(
        gate, [str(art), "--baseline", str(source), "--gate-file", str(empty), "--no-record"]
    )
    assert code == 2 and "nothing to measure" in err
    code, _, err = run(gate, [str(source), "--baseline", str(art), "--no-record"])
    assert code == 2 and "evaluates what ships" in err


def test_an_artifact_is_not_gated_against_itself(tmp_path: Path) -> None:
    art = build_artifact(tmp_path / "arts")
    code, _, err = run(gate, [str(art), "--baseline", str(art), "--no-record"])
    assert code == 2 and "are the same artifact" in err
    copy = shutil.copytree(art, tmp_path / "copy" / art.name)
    db = str(tmp_path / "r.db")
    code, _, err = run(gate, [str(art), "--baseline", str(copy), "--registry", db])
    assert code == 2 and "is not recorded" in err and "--no-record" in err
    with Registry(db) as reg:
        assert reg.gate_runs() == []
