"""The shipped recipes, one per model family, checked offline against the real config.json of
their models (tests/data/hub-configs, SOURCES.md there) in a hub cache without weights:
`kiln plan` needs config.json alone; `kiln validate` answers everything else and names the
weights and tokenizer a compile would still need."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.preflight import run_preflight
from kiln.compiler.recipe.recipe import load_recipe

ROOT = Path(__file__).parents[2]
HUB_CONFIGS = ROOT / "tests" / "data" / "hub-configs"
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("_"))
FAMILIES = {
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
}


def source(recipe: Path) -> str:
    return load_recipe(recipe).config.model.source


def hub_config(repo_id: str) -> Path:
    """The stored config.json of a hub model (files are named as the hub cache names repos)."""
    return HUB_CONFIGS / f"{repo_id.replace('/', '--')}.json"


HUB_RECIPES = [r for r in RECIPES if hub_config(source(r)).is_file()]
OTHER_RECIPES = [r for r in RECIPES if r not in HUB_RECIPES]


@pytest.fixture(scope="module")
def config_only_hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding each stored model's config.json and nothing else."""
    root = tmp_path_factory.mktemp("hub")
    for config in HUB_CONFIGS.glob("*.json"):
        repo = root / f"models--{config.stem}"
        snapshot = repo / "snapshots" / "0123456789abcdef"
        snapshot.mkdir(parents=True)
        shutil.copy2(config, snapshot / "config.json")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123456789abcdef")
    return root


@pytest.fixture
def offline(config_only_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(config_only_hub))
    # The recipes, not this machine's free disk (tests/compiler/test_disk_budget.py checks it).
    monkeypatch.setenv("KILN_NO_DISK_CHECK", "1")


def kiln(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def architecture(recipe: Path) -> str:
    return str(json.loads(hub_config(source(recipe)).read_text())["architectures"][0])


def test_every_family_has_a_shipped_recipe() -> None:
    assert {architecture(r) for r in HUB_RECIPES} >= FAMILIES


def test_every_recipe_names_a_builtin_model_or_a_hub_model_stored_here() -> None:
    assert [source(r) for r in OTHER_RECIPES if not source(r).startswith("builtin:")] == []


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_shipped_recipe_plans_from_config_json_alone(
    recipe: Path, offline: None, tmp_path: Path
) -> None:
    code, out = kiln("plan", recipe, "--json", "--output", tmp_path / "artifacts")
    assert code == 0, out
    plans = json.loads(out)
    plans.pop("disk")
    assert set(plans) == set(load_recipe(recipe).config.targets)
    assert all(plan["fits"] for plan in plans.values()), out


@pytest.mark.parametrize("recipe", HUB_RECIPES, ids=lambda p: p.stem)
def test_a_shipped_recipe_validates_but_for_the_checkpoint_files_it_lacks(
    recipe: Path, offline: None, tmp_path: Path
) -> None:
    code, out = kiln("validate", recipe, "--json", "--output", tmp_path / "artifacts")
    assert code == 2, out
    [problem] = json.loads(out)["problems"]  # every other check passed
    assert "model.source:" in problem
    assert "holds no weights (no *.safetensors or pytorch_model*.bin) and no tokenizer" in problem
    assert f"`hf download {source(recipe)}`" in problem


@pytest.mark.parametrize("recipe", OTHER_RECIPES, ids=lambda p: p.stem)
def test_a_shipped_recipe_of_a_builtin_model_validates(
    recipe: Path, offline: None, tmp_path: Path
) -> None:
    code, out = kiln("validate", recipe, "--output", tmp_path / "artifacts")
    assert code == 0, out


def test_phi_4_mini_plans_on_both_tensorrt_llm_paths_with_its_partial_rotary_embedding(
    offline: None,
) -> None:
    """Phi-4-mini rotates 96 of each head's 128 channels: kiln's runtime rotates those alone,
    and its recipe plans on both TensorRT-LLM paths (the 1.2 engine's rotary_pct, the
    PyTorch backend's partial_rotary_factor) for every target."""
    plan = run_preflight(load_recipe(ROOT / "recipes" / "phi-4-mini-fp8.yaml"), check_memory=False)
    assert plan.info.architecture == "Phi3ForCausalLM" and plan.info.unsupported() == []
    assert (plan.info.head_dim, plan.info.rotary_dim, plan.info.rope_type) == (128, 96, "longrope")
    assert plan.targets and all(t.capacity.fits for t in plan.targets.values())
    assert {n: (t.engine_problems, t.pytorch_problems) for n, t in plan.targets.items()} == {
        n: ((), ()) for n in plan.targets
    }


def config_only(model: Path, into: Path) -> Path:
    into.mkdir()
    shutil.copy2(model / "config.json", into / "config.json")
    return into


def recipe_for(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: config-only\nmodel:\n  source: {model}\nquantization:\n  method: gptq\n"
        "  group_size: 64\ncalibration:\n  dataset: builtin:licenses\n  num_samples: 4\n"
        f"targets: [h100-sxm]\noutput: {tmp_path / 'artifacts'}\n"
    )
    return path


def test_a_config_only_directory_plans(tmp_path: Path, tiny_llama: Path) -> None:
    model = config_only(tiny_llama, tmp_path / "model")
    code, out = kiln("plan", recipe_for(tmp_path, model))
    assert code == 0, out
    assert "h100-sxm" in out


def problems(recipe: Path) -> list[str]:
    """What `kiln validate --json` refuses the recipe for (it must refuse it)."""
    code, out = kiln("validate", recipe, "--json")
    assert code == 2, out
    return list(json.loads(out)["problems"])


def test_validate_names_what_a_config_only_directory_lacks_for_a_compile(
    tmp_path: Path, tiny_llama: Path
) -> None:
    model = config_only(tiny_llama, tmp_path / "model")
    [problem] = problems(recipe_for(tmp_path, model))
    assert f"{model} holds no weights (no *.safetensors or pytorch_model*.bin) and no " in problem
    assert "which a compile reads (`kiln plan` needs config.json alone)" in problem
    assert "copy the complete checkpoint into the directory" in problem


def test_validate_names_only_the_weights_beside_a_tokenizer(
    tmp_path: Path, tiny_llama: Path
) -> None:
    model = config_only(tiny_llama, tmp_path / "model")
    shutil.copy2(tiny_llama / "tokenizer.json", model / "tokenizer.json")
    [problem] = problems(recipe_for(tmp_path, model))
    assert f"{model} holds no weights (no *.safetensors or pytorch_model*.bin), which" in problem
