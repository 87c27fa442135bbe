"""The registry of methods and schemes: one declaration that the recipe and the checks share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.recipe.schema import QuantizationSection, section_spec
from kiln.quant.registry import GROUP_SIZES, METHODS, SCHEMES, group_size_problem
from kiln.quant.schemes import check
from kiln.quant.spec import QuantSpec


def test_every_scheme_belongs_to_registered_methods_and_every_method_has_a_scheme() -> None:
    named = {m for d in SCHEMES.values() for m in d.methods}
    assert named == set(METHODS)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_method_with_every_key_left_to_its_defaults_can_work(method: str) -> None:
    spec = section_spec(QuantizationSection(method=method))
    assert check(spec) == []


def test_gptq_at_8_bits_defaults_to_one_scale_per_output_channel() -> None:
    assert section_spec(QuantizationSection(method="gptq")).group_size == 128
    assert section_spec(QuantizationSection(method="gptq", weight_bits=8)).group_size is None


@pytest.mark.parametrize("group_size", [16, 48, 256])
def test_the_recipe_and_the_check_refuse_a_group_size_in_the_same_words(
    tmp_path: Path, tiny_llama: Path, group_size: int
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: x\nmodel:\n  source: {tiny_llama}\n"
        f"quantization:\n  method: gptq\n  group_size: {group_size}\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    [problem] = check(QuantSpec(method="gptq", weight_bits=4, group_size=group_size))
    assert problem == group_size_problem(group_size)
    assert info.value.problems == [
        f"{recipe}:6: quantization.group_size: {problem.problem} — "
        "use 128, 64 or 32, or leave it out for the method's default"
    ]


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_the_group_sizes_kiln_takes_pass_both(group_size: int) -> None:
    q = QuantizationSection(method="gptq", group_size=group_size)
    assert check(section_spec(q)) == []


def test_weight_bits_are_refused_together_with_every_other_schema_problem(
    tmp_path: Path, tiny_llama: Path
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: x\nmodel:\n  source: {tiny_llama}\n"
        "quantization:\n  method: awq\n  weight_bits: 8\ncalibration:\n  num_samples: 0\n"
    )
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe)
    assert [p.split(": ")[1] for p in info.value.problems] == [
        "quantization.weight_bits",
        "calibration.num_samples",
    ]
