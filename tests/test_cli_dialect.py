"""One dialect across `kiln`'s commands (issue 54): `--output`, `--json` and `--verify
[fast|full]` everywhere, an example in every help and help on every option, exit 2 for paths
and channels that name nothing, no wrapped lines in a pipe, every recipe problem at once,
`kiln compile --dry-run`, and progress counted per layer."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from kiln.compiler.cli.main import main
from kiln.compiler.cli.options import bare_verify
from kiln.compiler.cli.progress import Count, StepBars, StepLog, count_of
from kiln.gates.releases import Registry
from kiln.quant.layer_report import quantization_report
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.formats.artifact import load_manifest
from tests.benchmarks.scale import STAGE as SCALE_STAGE
from tests.gates.conftest import build_artifact


def kiln(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner(env=env).invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The command line of every command and group under `group`, groups first."""
    for name, command in sorted(group.commands.items()):
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def command_at(path: tuple[str, ...]) -> click.Command:
    command: click.Command = main
    for name in path:
        assert isinstance(command, click.Group)
        command = command.commands[name]
    return command


def leaves() -> list[tuple[str, ...]]:
    return [p for p in commands(main) if not isinstance(command_at(p), click.Group)]


# -- help ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [(), *commands(main)], ids=lambda p: " ".join(p) or "kiln")
def test_every_help_shows_an_example_of_its_own_command(path: tuple[str, ...]) -> None:
    code, help_text, _ = kiln(*path, "--help")
    assert code == 0
    example = help_text.split("Example:", 1)
    assert len(example) == 2, f"kiln {' '.join(path)} --help shows no example"
    first = example[1].strip().splitlines()[0]
    assert first.startswith(" ".join(("kiln", *path))), first


@pytest.mark.parametrize("path", list(commands(main)), ids=" ".join)
def test_every_option_says_what_it_does(path: tuple[str, ...]) -> None:
    silent = [
        param.opts[0]
        for param in command_at(path).params
        if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()
    ]
    assert silent == [], f"kiln {' '.join(path)}: options without help: {silent}"


@pytest.mark.parametrize("path", leaves(), ids=" ".join)
def test_every_command_prints_json_with_the_json_flag(path: tuple[str, ...]) -> None:
    [flag] = [p for p in command_at(path).params if "--json" in getattr(p, "opts", [])]
    assert isinstance(flag, click.Option) and flag.is_flag


def test_an_output_directory_is_spelled_output_everywhere() -> None:
    for path in leaves():
        options = {o for p in command_at(path).params for o in getattr(p, "opts", [])}
        assert "--out" not in options, path
    for name in ("validate", "plan", "compile", "search", "gate", "draft"):
        assert "--output" in kiln(name, "--help")[1], name


def test_the_old_spellings_still_work_unlisted(tmp_path: Path) -> None:
    missing = tmp_path / "m.jsonl"
    sides = ["http://127.0.0.1:9", "--baseline", "http://127.0.0.1:9", "--no-record"]
    code, _, err = kiln("gate", *sides, "--mirror-log", str(missing), "--out", str(tmp_path))
    assert code == 2 and f"{missing}: mirror log not found" in err  # --out was read
    code, _, err = kiln("draft", str(tmp_path / "none"), "--out", str(tmp_path / "d"),
                        "--prompts", "3")  # fmt: skip
    assert code == 2 and "model.source" in err  # both options were read
    for name, old in (("gate", "--out "), ("draft", "--out "), ("draft", "--prompts ")):
        assert old not in kiln(name, "--help")[1]
    assert "--num-prompts" in kiln("draft", "--help")[1]


# -- --verify --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["inspect", "gate", "serve", "promote", "rollback"])
def test_verify_takes_fast_or_full(name: str) -> None:
    [verify] = [p for p in command_at((name,)).params if p.name == "verify"]
    assert isinstance(verify.type, click.Choice) and list(verify.type.choices) == ["fast", "full"]


def test_a_bare_verify_means_full_before_an_argument_too() -> None:
    assert bare_verify(["--verify", "DIR"]) == ["--verify=full", "DIR"]
    assert bare_verify(["DIR", "--verify"]) == ["DIR", "--verify=full"]
    assert bare_verify(["--verify", "fast", "DIR"]) == ["--verify", "fast", "DIR"]
    assert bare_verify(["--", "--verify"]) == ["--", "--verify"]


def test_inspect_verifies_fast_or_full(tmp_path: Path) -> None:
    art = build_artifact(tmp_path)
    code, out, _ = kiln("inspect", "--verify", str(art))
    assert code == 0 and "verify: all digests match" in out
    code, out, _ = kiln("inspect", str(art), "--verify", "fast", "--json")
    assert code == 0
    shown = json.loads(out)
    assert (shown["verified"], shown["verify"], shown["problems"]) == (True, "fast", [])
    (art / "model" / "w.bin").write_bytes(b"changed")
    code, out, _ = kiln("inspect", str(art), "--verify", "fast", "--json")
    assert code == 3 and json.loads(out)["problems"][0].startswith("model/w.bin: sha256")


# -- exit 2 for what names nothing -----------------------------------------------------


def test_a_path_that_does_not_exist_exits_2(tmp_path: Path) -> None:
    nowhere = tmp_path / "nowhere"
    for args in (["inspect", str(nowhere)], ["promote", str(nowhere), "--channel", "prod",
                                              "--registry", str(tmp_path / "r.db")]):  # fmt: skip
        code, _, err = kiln(*args)
        assert code == 2 and f"{nowhere}: no such directory" in err, args


def test_history_of_an_unknown_channel_exits_2_naming_the_known_ones(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    with Registry(db) as reg:
        reg.configure_channel("prod")
        reg.configure_channel("staging")
    code, out, err = kiln("registry", "history", "nosuch", "--registry", db)
    assert code == 2 and out == ""
    assert "channel nosuch: no such channel" in err and "it has prod, staging" in err
    code, out, _ = kiln("registry", "history", "prod", "--registry", db)
    assert code == 0 and "prod: no promotions yet" in out


def test_channel_without_options_shows_it_and_never_creates_it(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    code, _, err = kiln("registry", "channel", "prod", "--registry", db)
    assert code == 2 and "no such channel" in err and "--rule current" in err
    with Registry(db) as reg:
        assert reg.ls() == []
    code, out, _ = kiln("registry", "channel", "prod", "--rule", "current", "--registry", db)
    assert code == 0 and "prod: baseline rule current; serves nothing" in out
    code, out, _ = kiln("registry", "channel", "prod", "--registry", db, "--json")
    assert code == 0 and json.loads(out)["baseline_rule"] == "current"


def test_a_baseline_digest_makes_the_rule_fixed(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    code, out, _ = kiln("registry", "channel", "prod", "--baseline", "f" * 64, "--registry", db)
    assert code == 0 and f"baseline rule fixed {'f' * 64}" in out
    code, _, err = kiln("registry", "channel", "prod", "--rule", "current", "--baseline", "f" * 64,
                        "--registry", db)  # fmt: skip
    assert code == 2 and "drop --baseline, or use --rule fixed" in err


def test_promote_rollback_and_history_print_one_json_document(tmp_path: Path) -> None:
    db = str(tmp_path / "r.db")
    arts = [build_artifact(tmp_path / "arts", f"v{i}".encode(), name=f"m{i}") for i in range(2)]
    digests = [load_manifest(a).digest for a in arts]
    with Registry(db) as reg:
        reg.configure_channel("prod", "fixed", "f" * 64)
        for art, digest in zip(arts, digests, strict=True):
            baseline = {"digest": "f" * 64, "kind": "source"}
            reg.record_gate_run({"passed": True, "candidate": {"digest": digest},
                                 "baseline": baseline}, art)  # fmt: skip
    for art in arts:
        code, out, err = kiln("promote", str(art), "--channel", "prod", "--registry", db, "--json")
        assert code == 0, err
        assert json.loads(out)["digest"] == load_manifest(art).digest
    code, out, _ = kiln("rollback", "prod", "--registry", db, "--json")
    assert code == 0
    event = json.loads(out)
    assert (event["action"], event["digest"], event["previous_digest"]) == ("rollback", *digests)
    code, out, _ = kiln("registry", "history", "prod", "--registry", db, "--json")
    assert code == 0
    history = json.loads(out)
    assert history["channel"] == "prod"
    assert [e["action"] for e in history["events"]] == ["promote", "promote", "rollback"]


# -- output in a pipe ------------------------------------------------------------------


def test_lines_are_not_wrapped_when_stdout_is_not_a_terminal(tmp_path: Path) -> None:
    deep = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 6))
    art = build_artifact(deep)
    code, out, _ = kiln("inspect", str(art), env={"COLUMNS": "40"})
    assert code == 0
    assert any(line.endswith(str(art)) and line.startswith("demo") for line in out.splitlines())


# -- every recipe problem at once ------------------------------------------------------


def test_validate_reports_schema_and_target_problems_together(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nmodel:\n  source: builtin:tiny\nquantization:\n  method: w9\n"
                      "targets: [h100-sxm, h1000]\n")  # fmt: skip
    code, out, _ = kiln("validate", str(recipe), "--json")
    assert code == 2
    problems = json.loads(out)["problems"]
    assert any("quantization.method: 'w9' is not allowed" in p for p in problems)
    assert any(f"{recipe}:6: targets.1: unknown GPU target 'h1000'" in p for p in problems)


# -- kiln compile --dry-run ------------------------------------------------------------


def tiny_recipe(tmp_path: Path, model: Path, method: str, targets: str = "[]") -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: tiny\nmodel:\n  source: {model}\nquantization:\n  method: {method}\n"
                      f"report:\n  num_samples: 2\n  max_seq_len: 32\ntargets: {targets}\n"
                      "output: out\n")  # fmt: skip
    return recipe


def test_dry_run_lists_the_stages_that_would_run_and_runs_none(
    tmp_path: Path, tiny_llama: Path
) -> None:
    recipe = tiny_recipe(tmp_path, tiny_llama, "gptq", "[h100-sxm]")
    code, out, err = kiln("compile", str(recipe), "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    stages = {row["stage"]: row["status"] for row in plan["stages"]}
    assert stages == dict.fromkeys(
        ["source", "quantize", "report", "export-tp1", "package"], "runs"
    )
    assert plan["disk"]["needed_bytes"] > 0
    assert not (tmp_path / "out").exists()
    code, out, _ = kiln("compile", str(recipe), "--dry-run")
    assert code == 0 and "5 of 5 stage(s) to run" in out and "export-tp1  runs" in out


def test_dry_run_after_a_compile_finds_every_stage_cached(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = tiny_recipe(tmp_path, tiny_llama, "none")
    code, _, err = kiln("compile", str(recipe), "--json")
    assert code == 0, err
    code, out, _ = kiln("compile", str(recipe), "--dry-run", "--json")
    assert code == 0
    assert {row["status"] for row in json.loads(out)["stages"]} == {"cached"}
    code, out, _ = kiln("compile", str(recipe), "--dry-run", "--force", "--json")
    assert {row["status"] for row in json.loads(out)["stages"]} == {"runs"}


# -- progress --------------------------------------------------------------------------


def test_a_count_is_read_from_the_end_of_a_message_only() -> None:
    assert count_of("subgraphs calibrated (3/33)") == Count("subgraphs calibrated", 3, 33)
    assert count_of("loading /models/llama-3/8b for llmcompressor") is None
    assert count_of("distilling: step 3/100, KL 0.1") is None


def test_a_count_that_names_its_stage_is_logged_under_it() -> None:
    """The report counts its batches while the export announces its steps beside it: the
    log charges each count to the stage it names, not to the step announced last."""
    assert count_of("draft: report: quantised model batches run (3/8)") == Count(
        "quantised model batches run", 3, 8, "draft: report"
    )
    now, lines = [0.0], []
    log = StepLog(lines.append, clock=lambda: now[0])
    log("report: per-layer error and KL divergence on held-out text")
    log("export: ModelOpt HF checkpoint for the PyTorch path")
    now[0] = 11.0
    log("report: quantised model batches run (1/8)")
    now[0] = 22.0
    log("subgraphs calibrated (2/9)")  # names none: the last step's stage
    steps = [line.split(" ", 1)[1] for line in lines]
    assert steps[2].startswith("report: quantised model batches run 1/8, ")
    assert steps[3].startswith("export: subgraphs calibrated 2/9, ")
    bars = StepBars(Console(file=io.StringIO(), force_terminal=True, width=120))
    with bars.shown():
        bars("report: per-layer error and KL divergence on held-out text")
        bars("report: quantised model batches run (2/3)")
        assert [t.fields["label"] for t in bars.bars.tasks] == ["quantised model batches run"]


def test_the_pipeline_names_the_reports_messages_and_leaves_named_ones() -> None:
    from kiln.compiler.pipeline import _named

    heard: list[str] = []
    for who in ("", "draft: "):
        say = _named(heard.append, f"{who}report")
        say("quantised model batches run (1/8)")
        say("report: the float model's log-probabilities made beforehand do not serve")
    assert heard == [
        "report: quantised model batches run (1/8)",
        "report: the float model's log-probabilities made beforehand do not serve",
        "draft: report: quantised model batches run (1/8)",
        "report: the float model's log-probabilities made beforehand do not serve",
    ]


def test_a_log_keeps_every_step_and_counts_at_most_every_ten_seconds() -> None:
    now, lines = [0.0], []
    log = StepLog(lines.append, clock=lambda: now[0])
    log("quantize: W4A16_GPTQ with llmcompressor")
    for second in range(1, 36):
        now[0] = float(second)
        log(f"subgraphs calibrated ({second}/35)")
    log("saving compressed-tensors checkpoint")
    steps = [line.split(" ", 1)[1] for line in lines]
    assert steps == [
        "quantize: W4A16_GPTQ with llmcompressor",
        "quantize: subgraphs calibrated 10/35, 0:00:09 elapsed, about 0:00:25 left",
        "quantize: subgraphs calibrated 20/35, 0:00:19 elapsed, about 0:00:15 left",
        "quantize: subgraphs calibrated 30/35, 0:00:29 elapsed, about 0:00:05 left",
        "saving compressed-tensors checkpoint",
    ]
    assert all(SCALE_STAGE.match(line) for line in lines[:4])  # the stage scale.py charges


def test_a_terminal_shows_a_row_per_step_and_a_bar_per_count() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    with StepBars(terminal).shown() as bars:
        bars("report: per-layer error and KL divergence on held-out text")
        bars("layers' weights compared (1/4)")
        bars("float model batches run (2/3)")
        rows = [(t.description, t.completed, t.total, t.finished) for t in bars.bars.tasks]
    assert rows == [
        ("report: per-layer error and KL divergence on held-out text", 4, 4, True),
        ("  float model batches run", 2, 3, False),
    ]


def test_quantise_and_report_count_their_layers_and_batches(
    tiny_llama: Path, tmp_path: Path
) -> None:
    heard: list[str] = []
    calibration = CalibrationSpec(dataset="builtin:licenses", num_samples=4, max_seq_len=32)
    scheme = resolve(QuantSpec(method="gptq", weight_bits=4, group_size=64))
    quantize(tiny_llama, scheme, calibration, tmp_path / "q", progress=heard.append)
    counts = [c for c in map(count_of, heard) if c is not None]
    subgraphs = counts[-1].total
    assert subgraphs >= 2  # a decoder layer each, and what follows the last
    assert [c.done for c in counts] == list(range(subgraphs + 1))
    heard.clear()
    texts = ["The quick brown fox jumps over the lazy dog. " * 4] * 3
    quantization_report(tiny_llama, tmp_path / "q", texts, max_seq_len=32, progress=heard.append)
    last = {c.what: c for c in map(count_of, heard) if c is not None}
    assert set(last) == {"layers' weights compared", "float model batches run",
                         "quantised model batches run"}  # fmt: skip
    assert all(c.done == c.total > 0 for c in last.values())
