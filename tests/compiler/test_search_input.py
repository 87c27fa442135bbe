"""`kiln search` on hostile input: its own defaults are a space kiln accepts; empty lists
and out-of-range numbers are usage errors naming the option; a resumed state is one written
under the same recipe, settings and tools; a damaged state, a search directory that is a
file, a deleted parent artifact and a search with nothing to judge each say what to do,
and a search that judged nothing leaves nothing of its own behind."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.recipe.schema import QuantizationSection, section_spec
from kiln.compiler.search.run import Search
from kiln.compiler.search.settings import SearchSettings
from kiln.compiler.search.space import KV_VARIANTS, SCHEMES, quantization_section
from kiln.compiler.search.state import read_state, state_key, write_state
from kiln.quant.schemes import check
from kiln.runtime.formats.model_info import ModelInfo
from tests.compiler.test_compile import kiln
from tests.compiler.test_search import search, search_recipe

QUICK = ("--schemes", "w8a16", "--kv-cache", "none", "--no-measure", "--no-mixed")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    monkeypatch.setenv("KILN_REGISTRY", str(tmp_path / "registry.db"))


def one_line(text: str) -> str:
    return " ".join(text.split())  # progress lines wrap at the console's width


# ---- the default space -----------------------------------------------------------------


def test_every_default_candidate_is_one_kilns_own_validation_accepts(tiny_llama: Path) -> None:
    info = ModelInfo.from_hf_config(json.loads((tiny_llama / "config.json").read_text()))
    for name in SCHEMES:
        for kv in KV_VARIANTS:
            section = QuantizationSection(**quantization_section(name, kv, ["lm_head"], info))
            assert check(section_spec(section), info) == [], (name, kv)


def test_a_search_with_no_options_runs_its_own_defaults(tiny_llama: Path, tmp_path: Path) -> None:
    """Every scheme and KV variant, mixed precision, the early look and the measured speed,
    as a user gets them; only the number of candidates is capped, to stay short."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--max-candidates", "1")
    assert code == 0, stderr
    answer = json.loads((tmp_path / "out" / "search-planted" / "search.json").read_text())
    assert answer["targets"]["h100-sxm"]["winner"] is not None
    assert not any("kiln refuses it" in note for note in answer["notes"])


# ---- the command line ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("--schemes", "", "fp8, fp8_dynamic, w8a8"),
        ("--kv-cache", " , ", "none, fp8"),
        ("--target", "", "h100-sxm"),
    ],
)
def test_an_empty_list_is_a_usage_error_naming_the_option_and_its_values(
    tiny_llama: Path, tmp_path: Path, option: str, value: str, allowed: str
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), option, value)
    assert code == 2 and option in stderr and allowed in stderr
    assert not (tmp_path / "out").exists()


def test_an_empty_list_in_the_recipe_is_refused_too(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0, extra="search: {schemes: []}\n")
    code, _, stderr = kiln("search", str(recipe))
    assert code == 2 and "search.schemes is empty" in stderr and "w4a16_awq" in stderr


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("--max-candidates", "0", "greater than or equal to 1"),
        ("--max-candidates", "-2", "greater than or equal to 1"),
        ("--budget-hours", "0", "greater than 0"),
        ("--budget-hours", "-1", "greater than 0"),
        ("--budget-hours", "nan", "finite number"),
        ("--budget-hours", "inf", "finite number"),
    ],
)
def test_a_budget_is_checked_as_the_recipes_search_section_checks_it(
    tiny_llama: Path, tmp_path: Path, option: str, value: str, why: str
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), option, value)
    assert code == 2 and f"error: {option} " in stderr and why in stderr
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_a_file_is_named(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--output", str(recipe))
    assert code == 2 and f"{recipe} is a file" in stderr and "--output" in stderr


# ---- nothing to judge ----------------------------------------------------------------------


def test_a_target_that_runs_no_scheme_is_refused_before_anything_is_written(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = kiln("search", str(recipe), "--target", "l4", "--schemes", "nvfp4")
    assert code == 2
    assert "no candidate to judge on l4" in stderr and "no FP4 tensor cores" in stderr
    assert not (tmp_path / "out").exists()


def test_missing_calibration_data_is_refused_before_anything_is_written(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    recipe.write_text(recipe.read_text().replace("builtin:licenses", "missing.jsonl"))
    code, _, stderr = kiln("search", str(recipe), *QUICK)
    assert code == 2 and "calibration.dataset" in stderr and "missing.jsonl" in stderr
    assert not (tmp_path / "out").exists()


def test_a_search_that_judges_nothing_keeps_what_an_earlier_run_left(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A resumed state whose only candidate kiln compile refused: nothing is judged (exit 2,
    the refusal named), and the earlier run's files are all still there, unchanged."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, _, stderr = search(recipe, *QUICK)
    assert code == 0, stderr
    out = tmp_path / "out" / "search-planted"
    state = json.loads((out / "state.json").read_text())
    state["candidates"][0].update(quality=None, refused="calibration ran out of memory")
    (out / "state.json").write_text(json.dumps(state))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, stderr = search(recipe, *QUICK)
    assert code == 2
    assert "judged no candidate" in stderr and "w8a16: calibration ran out of memory" in stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# ---- resuming ------------------------------------------------------------------------------


def test_changed_gate_thresholds_judge_every_candidate_afresh(
    tiny_llama: Path, tmp_path: Path
) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, first, stderr = search(recipe, *QUICK)
    assert code == 0, stderr
    search_recipe(tmp_path, tiny_llama, kl_max=1e-12)  # the same file, a stricter gate
    code, second, stderr = search(recipe, *QUICK)
    assert code == 1  # w8a16 no longer passes: judged again, not resumed
    said = one_line(stderr)
    assert "not resuming" in said and "the recipe's gates: changed" in said
    assert second["resumed"] == 0 and not second["candidates"][0]["quality"]["passed"]
    out = tmp_path / "out" / "search-planted"
    kept = [p for p in out.glob("state-*.json")]  # the earlier state, set aside
    assert len(kept) == 1 and json.loads(kept[0].read_text())["candidates"] == first["candidates"]


SETTINGS = {"targets": ["h100-sxm"], "schemes": ["w8a16"], "kv_cache": ["none"],
            "mixed": False, "early_stop": True}  # fmt: skip


def test_a_state_written_by_other_tools_is_not_resumed(tiny_llama: Path, tmp_path: Path) -> None:
    recipe = load_recipe(search_recipe(tmp_path, tiny_llama, kl_max=1.0))
    key = state_key(recipe, SETTINGS)
    old = {**key, "tools": {**key["tools"], "torch": "1.0.0"}}
    write_state(tmp_path, recipe.path, old, [])
    rows, changed = read_state(tmp_path, recipe.path, key)
    assert rows == [] and changed is not None
    assert f"torch 1.0.0 → {torch.__version__}" in changed


def test_a_change_in_an_extended_recipe_changes_the_key(tiny_llama: Path, tmp_path: Path) -> None:
    base = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    child = tmp_path / "child.yaml"
    child.write_text("extends: recipe.yaml\nname: child\n")
    key = state_key(load_recipe(child), SETTINGS)
    base.write_text(base.read_text().replace("limit: 8", "limit: 16"))
    changed = state_key(load_recipe(child), SETTINGS)
    write_state(tmp_path, child, key, [])
    assert (
        read_state(tmp_path, child, changed)[1]
        == "the recipe's gates: changed since it was written"
    )
    assert read_state(tmp_path, child, key)[1] is None  # the same key: resumed


@pytest.mark.parametrize("text", ["{not json", "[]", '{"recipe": 1, "candidates": [{}]}'])
def test_a_damaged_state_is_named_with_the_fix(tiny_llama: Path, tmp_path: Path, text) -> None:
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    out = tmp_path / "search"
    out.mkdir()
    (out / "state.json").write_text(text)
    code, _, stderr = kiln("search", str(recipe), "--output", str(out), *QUICK)
    assert code == 2
    assert f"{out / 'state.json'}: cannot be read as a kiln search state" in stderr
    assert f"delete {out / 'state.json'} to search afresh" in stderr
    assert [p.name for p in out.iterdir()] == ["state.json"]  # nothing compiled


def test_a_resumed_verdict_is_one_a_gate_gave_and_names_an_artifact_that_exists(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A state whose quality is NaN is not resumed as a verdict (exit 2 naming the file and
    the field); a passing candidate whose artifact was deleted since is compiled again, so the
    answer never names an artifact that is gone."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1.0)
    code, first, stderr = search(recipe, *QUICK)
    assert code == 0, stderr
    out = tmp_path / "out" / "search-planted"
    good = (out / "state.json").read_text()
    state = json.loads(good)
    state["candidates"][0]["quality"]["kl_mean"] = math.nan
    (out / "state.json").write_text(json.dumps(state))  # written as the literal NaN
    code, _, stderr = search(recipe, *QUICK)
    assert code == 2
    said = one_line(stderr)
    assert f"{out / 'state.json'}: cannot be read as a kiln search state" in said
    assert "w8a16's quality.kl_mean is nan" in said
    (out / "state.json").write_text(good)
    artifact = Path(first["candidates"][0]["artifact"])
    (artifact / "manifest.json").unlink()
    code, second, stderr = search(recipe, *QUICK)
    assert code == 0, stderr
    assert "its artifact" in stderr and "compiling it again" in one_line(stderr)
    assert second["resumed"] == 1
    again = Path(second["candidates"][0]["artifact"])
    assert (again / "manifest.json").is_file()
    assert second["targets"]["h100-sxm"]["winner"] == "w8a16"
    (row,) = second["targets"]["h100-sxm"]["rows"]
    assert row["artifact"] == str(again)


def test_a_deleted_parent_artifact_is_compiled_again_for_the_mixed_search(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """The mixed candidates' parent (a failed uniform one) needs its per-layer report: its
    artifact, deleted since the last run, is compiled again (the same recipe and tools, so
    its verdict still holds) and the mixed search goes on."""
    recipe = search_recipe(tmp_path, tiny_llama, kl_max=1e-12)
    args = ("--schemes", "w8a16", "--kv-cache", "none", "--no-measure")
    code, first, stderr = search(recipe, *args, "--max-candidates", "2")
    assert code == 1, stderr
    assert [c["id"] for c in first["candidates"]] == ["w8a16", "w8a16-keep1"]
    parent = Path(first["candidates"][0]["artifact"])
    shutil.rmtree(parent)
    code, second, stderr = search(recipe, *args, "--max-candidates", "3")
    assert code == 1, stderr
    assert "is gone; compiling it again" in one_line(stderr)
    assert second["resumed"] == 2 and second["candidates"][2]["id"] == "w8a16-keep2"
    assert Path(second["candidates"][0]["artifact"]).is_dir()


def test_undoing_a_run_removes_what_it_made_and_nothing_else(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """What a search that judged nothing removes: the directories it created (up to the
    first that existed), or, in a directory an earlier run left, only its own new files,
    with the earlier state it had set aside put back."""
    recipe = load_recipe(search_recipe(tmp_path, tiny_llama, kl_max=1.0))
    settings = SearchSettings(schemes=["w8a16"], kv_cache=["none"], mixed=False)
    fresh = Search(recipe, settings, tmp_path / "new" / "search", None, print)
    fresh.start()
    fresh.save_state()
    fresh.undo()
    assert not (tmp_path / "new").exists()

    earlier = tmp_path / "earlier"
    (earlier / "candidates").mkdir(parents=True)
    (earlier / "candidates" / "fp8.yaml").write_text("kept\n")
    (earlier / "state.json").write_text(json.dumps({"recipe": str(recipe.path), "candidates": []}))
    again = Search(recipe, settings, earlier, None, print)
    again.load_state()  # no key: written by an earlier kiln, so set aside at the first save
    again.start()
    again.write_recipe(again.space()[0])
    again.save_state()
    assert len(list(earlier.glob("state-*.json"))) == 1
    again.undo()
    assert sorted(p.relative_to(earlier).as_posix() for p in earlier.rglob("*")) == [
        "candidates", "candidates/fp8.yaml", "state.json",
    ]  # fmt: skip
    assert "key" not in json.loads((earlier / "state.json").read_text())
