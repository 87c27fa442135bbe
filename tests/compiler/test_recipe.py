"""The recipe's contract: every problem reported at once as file:line: key: problem — fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import load_recipe


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def validate(recipe: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["validate", str(recipe)])
    return result.exit_code, result.output


@pytest.fixture
def good(tmp_path: Path, tiny_llama: Path) -> Path:
    return write(
        tmp_path / "good.yaml",
        f"""\
name: tiny-gptq
model:
  source: {tiny_llama}
quantization:
  method: gptq
  group_size: 64
calibration:
  dataset: builtin:licenses
  num_samples: 8
  max_seq_len: 64
targets: [h100-sxm]
""",
    )


def test_valid_recipe_passes_with_method_defaults(good: Path) -> None:
    code, output = validate(good)
    assert code == 0, output
    spec = load_recipe(good).quant_spec()
    assert (spec.weight_bits, spec.group_size, spec.symmetric, spec.activations) == (
        4,
        64,
        True,
        "none",
    )


def test_unknown_key_names_file_line_and_allowed_keys(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        f"name: x\nmodel:\n  source: {tiny_llama}\nquantisation:\n  method: gptq\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert (
        f"{recipe}:4: quantisation: unknown key — allowed keys: name, model, quantization" in output
    )


def test_unknown_method_lists_the_methods(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        f"name: x\nmodel:\n  source: {tiny_llama}\nquantization:\n  method: int3\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:5: quantization.method: 'int3' is not allowed — use 'none', 'fp8'" in output


def test_every_problem_is_reported_at_once(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        f"""\
name: Bad Name
model:
  source: {tiny_llama}
quantization:
  method: gptq
  group_size: 48
calibration:
  num_samples: 0
""",
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    problems = info.value.problems
    assert len(problems) == 3
    assert problems[0].startswith(f"{recipe}:1: name: 'Bad Name' is not a valid name")
    assert problems[1].startswith(
        f"{recipe}:6: quantization.group_size: group size 48 is not one that kiln's quantisers"
    )
    assert problems[2].startswith(f"{recipe}:8: calibration.num_samples:")


def test_group_size_that_does_not_divide_the_model_is_caught_before_loading(
    tmp_path: Path,
) -> None:
    # SmolLM2-135M's shapes: hidden 576 is not a multiple of 128. Only config.json exists, so
    # the check provably runs without weights.
    model = tmp_path / "smollm2-shapes"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, '
        '"intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, '
        '"num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192}'
    )
    recipe = write(
        tmp_path / "r.yaml",
        f"name: x\nmodel:\n  source: {model}\nquantization:\n  method: gptq\n  group_size: 128\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:6: quantization.group_size:" in output
    assert "576 is not divisible by 128" in output and "use 64 or 32" in output


def test_bits_that_the_method_cannot_produce(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        f"name: x\nmodel:\n  source: {tiny_llama}\n"
        "quantization:\n  method: awq\n  weight_bits: 8\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert (
        f"{recipe}:6: quantization.weight_bits: awq does not quantise weights to 8 bits — use 4"
        in output
    )


def test_missing_recipe_file(tmp_path: Path) -> None:
    code, output = validate(tmp_path / "nope.yaml")
    assert code == 2
    assert "nope.yaml: file not found" in output


def test_missing_model_and_calibration_files(tmp_path: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        "name: x\nmodel:\n  source: ./no-such-model\n"
        "quantization:\n  method: gptq\n  group_size: 64\n"
        "calibration:\n  dataset: ./missing.jsonl\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:3: model.source:" in output
    assert f"{recipe}:8: calibration.dataset:" in output


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, '
        '"n_layer": 2, "n_head": 2, "vocab_size": 100, "n_positions": 64}'
    )
    recipe = write(tmp_path / "r.yaml", f"name: x\nmodel:\n  source: {model}\n")
    code, output = validate(recipe)
    assert code == 2
    assert "GPT2LMHeadModel" in output
    assert "LlamaForCausalLM" in output and "Qwen2ForCausalLM" in output


def test_unknown_target_lists_known_targets(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        f"name: x\nmodel:\n  source: {tiny_llama}\ntargets: [h100-sxm, h1000]\n",
    )
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:4: targets.1: unknown GPU target 'h1000' — known targets:" in output


def test_extends_merges_base_and_reports_lines_in_the_file_that_set_them(
    tmp_path: Path, tiny_llama: Path
) -> None:
    base = write(
        tmp_path / "base.yaml",
        f"""\
model:
  source: {tiny_llama}
quantization:
  method: gptq
  group_size: 48
calibration:
  num_samples: 8
""",
    )
    child = write(
        tmp_path / "team" / "child.yaml" if (tmp_path / "team").mkdir() is None else base,
        "extends: ../base.yaml\nname: child\nquantization:\n  weight_bits: 8\n",
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(child)
    assert info.value.problems == [
        f"{base}:5: quantization.group_size: group size 48 is not one that kiln's quantisers "
        "and runtime take — use 128, 64 or 32, or leave it out for the method's default"
    ]
    base.write_text(base.read_text().replace("48", "64"))
    recipe = load_recipe(child)
    spec = recipe.quant_spec()
    assert (spec.method, spec.weight_bits, spec.group_size) == ("gptq", 8, 64)
    assert recipe.config.calibration.num_samples == 8


def test_extends_cycle_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "extends: b.yaml\nname: a\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\nname: b\n")
    code, output = validate(tmp_path / "a.yaml")
    assert code == 2
    assert "extends: cycle" in output and "a.yaml" in output and "b.yaml" in output


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    recipe = write(tmp_path / "r.yaml", "name: x\nmodel: [unclosed\n")
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:" in output and "invalid YAML" in output


def test_duplicate_keys_are_refused(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = write(tmp_path / "r.yaml", f"name: x\nmodel:\n  source: {tiny_llama}\nname: y\n")
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:4: name: duplicate key" in output


# ---- hostile recipe files: refused with exit 2 and a short message -----------------------


def billion_laughs(levels: int, under: str = "name") -> str:
    """Each level an anchored list of nine aliases to the one before: 9**levels values."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join([*lines, f"{under}: *l{levels - 1}", ""])


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path: Path) -> None:
    recipe = write(tmp_path / "bomb.yaml", billion_laughs(6))  # 531,441 strings expanded
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:5: refused: its aliases expand to more than" in output
    assert len(output) < 1000


def test_an_alias_that_contains_itself_is_refused(tmp_path: Path) -> None:
    recipe = write(tmp_path / "loop.yaml", "name: &a [x, *a]\n")
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:1: refused: an alias refers to a value that contains it" in output


def test_deep_nesting_is_refused_with_its_line(tmp_path: Path) -> None:
    recipe = write(tmp_path / "deep.yaml", "name: x\nmodel: " + "[" * 5000 + "]" * 5000 + "\n")
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}:2: refused: nested deeper than" in output


def test_aliases_that_nest_deep_are_refused(tmp_path: Path) -> None:
    # Each anchor is shallow; expanded, the chain reaches far below the bound.
    lines = ["a0: &a0 [[[[x]]]]"] + [f"a{i}: &a{i} [[[[*a{i - 1}]]]]" for i in range(1, 40)]
    recipe = write(tmp_path / "chain.yaml", "\n".join([*lines, "name: *a39", ""]))
    code, output = validate(recipe)
    assert code == 2
    assert "refused: its aliases nest deeper than" in output


def test_many_bad_values_print_a_bounded_report(tmp_path: Path, tiny_llama: Path) -> None:
    values = ", ".join(["[1, 2]"] * 500)
    huge = "9" * 5000 + "x"
    text = f"name: x\nmodel:\n  source: {tiny_llama}\ntargets: [{values}]\n"
    recipe = write(tmp_path / "r.yaml", text + f"deploy: {{max_batch_size: '{huge}'}}\n")
    code, output = validate(recipe)
    assert code == 2
    assert "... and 451 more; fix these first" in output
    assert len(output) < 20_000
    assert "9" * 200 not in output  # a huge bad value is quoted cut short


def test_a_binary_recipe_is_a_recipe_error(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"name: x\n\xff\xfe\x00garbage")
    code, output = validate(recipe)
    assert code == 2
    assert f"{recipe}: not UTF-8 text" in output


def test_extends_reads_only_recipe_files_and_never_echoes_another_file(tmp_path: Path) -> None:
    secret = "hunter2: the-password\nsecret-key: x\n"
    (tmp_path / "secret.txt").write_text(secret)
    (tmp_path / "secret.yaml").write_text(secret)
    for target in ("secret.txt", str(tmp_path / "secret.yaml"), "/etc/passwd"):
        recipe = write(tmp_path / "r.yaml", f"name: x\nextends: {target}\n")
        code, output = validate(recipe)
        assert code == 2, output
        assert f"{recipe}:2: extends:" in output
        assert "hunter2" not in output and "the-password" not in output and "root:" not in output
    assert "is not a kiln recipe" in output or "is not a recipe file" in output


@pytest.mark.parametrize("written", ["1e-2", "1.0e-2", "1E-2", ".1e-1", "10e-3", "+1e-2"])
def test_an_exponent_float_is_a_number_as_yaml_1_2_reads_it(
    tmp_path: Path, good: Path, written: str
) -> None:
    """PyYAML's YAML 1.1 reads `1e-2` as a string: a recipe reads it as every other tool does,
    in the file it names and in one it extends alike."""
    write(tmp_path / "base.yaml", f"deploy:\n  kv_free_fraction: {written}\n")
    text = good.read_text().replace(
        "group_size: 64", f"group_size: 64\n  dampening_frac: {written}"
    )
    config = load_recipe(write(tmp_path / "child.yaml", "extends: base.yaml\n" + text)).config
    assert config.quantization.dampening_frac == pytest.approx(0.01)
    assert config.deploy.kv_free_fraction == pytest.approx(0.01)


def test_a_quoted_number_is_refused_saying_it_is_text(good: Path) -> None:
    good.write_text(good.read_text().replace("max_seq_len: 64", 'max_seq_len: "64"'))
    code, output = validate(good)
    assert code == 2
    assert f"{good}:10: calibration.max_seq_len: '64' is text, not a number" in output
    assert "write it unquoted: 64" in output


def test_a_float_where_an_integer_is_needed_names_the_integer(good: Path) -> None:
    good.write_text(good.read_text().replace("num_samples: 8", "num_samples: 1e2"))
    code, output = validate(good)
    assert code == 2
    assert f"{good}:9: calibration.num_samples: 100.0 is a float" in output
    assert "not an integer — write 100" in output
