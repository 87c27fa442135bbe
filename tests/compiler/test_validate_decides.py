"""`kiln validate` decides everything the recipe and the model's files alone decide, with
file:line, so `kiln compile` never spends compute on a recipe that was going to fail: the
model's weights against its config, its tokenizer, the ignore list, the lengths asked for,
the gate's tasks, the output path, and values taken as typed (`true` is no number)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main


def recipe(tmp_path: Path, source: Path, extra: str = "", quant: str = "") -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: checked\nmodel:\n  source: {source}\nquantization:\n  method: gptq\n"
        f"  group_size: 64\n{quant}calibration:\n  dataset: builtin:licenses\n"
        f"  num_samples: 4\n{extra}"
    )
    return path


def validate(path: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["validate", str(path)])
    return result.exit_code, result.output


def copy_model(tiny_llama: Path, into: Path) -> Path:
    shutil.copytree(tiny_llama, into)
    return into


def test_a_config_that_does_not_match_its_weights_is_refused(tmp_path: Path, tiny_llama: Path):
    model = copy_model(tiny_llama, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    code, out = validate(recipe(tmp_path, model))
    assert code == 2 and "model.source" in out
    assert "in the weights but config.json implies" in out


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path: Path, tiny_llama: Path):
    model = copy_model(tiny_llama, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    code, out = validate(recipe(tmp_path, model))
    assert code == 2 and "holds no tokenizer" in out


def test_an_ignore_list_that_keeps_every_linear_float_is_refused(tmp_path: Path, tiny_llama):
    path = recipe(tmp_path, tiny_llama, quant='  ignore: ["re:.*"]\n')
    code, out = validate(path)
    assert code == 2 and "quantization.ignore" in out and "nothing would be quantised" in out


def test_an_ignore_entry_that_matches_nothing_is_refused(tmp_path: Path, tiny_llama: Path):
    code, out = validate(recipe(tmp_path, tiny_llama, quant="  ignore: [lm_head, mlp.gate]\n"))
    assert code == 2 and "'mlp.gate' matches no linear" in out


def test_an_invalid_ignore_pattern_names_the_file_and_key(tmp_path: Path, tiny_llama: Path):
    code, out = validate(recipe(tmp_path, tiny_llama, quant='  ignore: ["re:(unclosed"]\n'))
    assert code == 2
    assert "recipe.yaml:" in out and "quantization.ignore" in out and "regular expression" in out


def test_an_unknown_gate_task_is_refused_before_compiling(tmp_path: Path, tiny_llama: Path):
    code, out = validate(recipe(tmp_path, tiny_llama, extra="gates:\n  tasks: [kiln_nope]\n"))
    assert code == 2 and "gates.tasks" in out and "kiln_nope" in out


def test_a_nul_byte_in_output_is_a_recipe_error(tmp_path: Path, tiny_llama: Path):
    code, out = validate(recipe(tmp_path, tiny_llama, extra='output: "out\\0put"\n'))
    assert code == 2 and "output" in out and "NUL" in out


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("deploy:\n  max_seq_len: 100000\n", "deploy.max_seq_len"),
        ("targets: [h100-sxm]\n", None),  # the planner's default length is not the recipe's
    ],
)
def test_a_length_past_the_models_positions_is_refused(
    tmp_path: Path, tiny_llama: Path, extra: str, key: str | None
) -> None:
    code, out = validate(recipe(tmp_path, tiny_llama, extra=extra))
    if key is None:
        assert "max_position_embeddings" not in out
    else:
        assert code == 2 and key in out and "max_position_embeddings" in out


def test_a_calibration_length_past_the_models_positions_is_refused(tmp_path, tiny_llama):
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: checked\nmodel:\n  source: {tiny_llama}\nquantization:\n  method: gptq\n"
        "  group_size: 64\ncalibration:\n  dataset: builtin:licenses\n  num_samples: 4\n"
        "  max_seq_len: 30000\n"
    )
    code, out = validate(path)
    assert code == 2 and "calibration.max_seq_len" in out


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("calibration:\n  num_samples: true\n", "calibration.num_samples"),
        ("deploy:\n  gpu_price_per_hour: .inf\n", "deploy.gpu_price_per_hour"),
        ('deploy:\n  max_batch_size: "8"\n', "deploy.max_batch_size"),
    ],
)
def test_values_are_taken_as_typed(tmp_path: Path, tiny_llama: Path, extra: str, key: str):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: checked\nmodel:\n  source: {tiny_llama}\n{extra}")
    code, out = validate(path)
    assert code == 2 and key in out


def test_extending_a_file_with_other_keys_says_nothing_of_them(tmp_path: Path, tiny_llama):
    foreign = tmp_path / "foreign.yaml"
    foreign.write_text("name: x\nsecret_database_password: hunter2\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(f"extends: foreign.yaml\nname: checked\nmodel:\n  source: {tiny_llama}\n")
    code, out = validate(path)
    assert code == 2 and "is not a kiln recipe" in out
    assert "secret_database_password" not in out and "hunter2" not in out
