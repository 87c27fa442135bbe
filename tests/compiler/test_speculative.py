"""Speculative decoding in the compiler: the recipe's `speculative:` section, the tokenizer
check before calibration, the nested draft artifact with auto-chosen K, the TensorRT-LLM
flags and serve YAML it feeds, and `kiln draft`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from kiln.compiler.cli.main import main
from kiln.compiler.draft.tokenizer_match import tokenizer_differences, tokenizer_facts
from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.sources import parse_source
from kiln.runtime.formats import artifact

SMALL_AUTO = "  auto_prompts: 2\n  auto_max_tokens: 8\n  auto_max_k: 4\n"
EXTERNAL = "  external_draft_engine: true\n"


def kiln(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def recipe_file(
    tmp_path: Path, model: Path, speculative: str, method: str = "gptq", name: str = "recipe"
) -> Path:
    quant = "  method: gptq\n  group_size: 64\n" if method == "gptq" else f"  method: {method}\n"
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""\
name: tiny-spec
model:
  source: {model}
quantization:
{quant}calibration:
  dataset: builtin:licenses
  num_samples: 8
  max_seq_len: 64
report:
  num_samples: 4
  max_seq_len: 64
targets: [h100-sxm]
output: out
speculative:
{speculative}""")
    return path


def analytic_best_k(alpha: float, c: float, max_k: int) -> int:
    """argmax over K of (1 − α^(K+1)) / ((1 − α)(K·c + 1)), written out independently."""

    def speedup(k: int) -> float:
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / (k * c + 1)

    return max(range(1, max_k + 1), key=speedup)


@pytest.fixture(scope="module")
def made_draft(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> tuple[Path, dict]:
    """`kiln draft` of the tiny Llama: one layer, a few distillation steps, measured."""
    out = tmp_path_factory.mktemp("draft") / "tiny-draft"
    code, stdout, stderr = kiln(
        "draft",
        str(tiny_llama),
        "--layers",
        "1",
        "--distill-steps",
        "6",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--prompts",
        "2",
        "--max-tokens",
        "8",
        "--max-k",
        "4",
        "--out",
        str(out),
        "--json",
    )
    assert code == 0, stderr
    return out, json.loads(stdout)


def mismatched_copy(draft: Path, dest: Path) -> Path:
    """The draft with its end-of-sequence special token renamed in tokenizer.json."""
    shutil.copytree(draft, dest)
    data = json.loads((dest / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token["content"] = "<|end|>"
    vocab = data["model"]["vocab"]
    vocab["<|end|>"] = vocab.pop("<|im_end|>")
    (dest / "tokenizer.json").write_text(json.dumps(data))
    return dest


# ---- the recipe section ------------------------------------------------------------------


def test_speculative_section_defaults_and_draft_shorthand(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = load_recipe(recipe_file(tmp_path, tiny_llama, f"  draft: {tiny_llama}\n"))
    section = recipe.config.speculative
    assert section is not None and section.draft is not None
    assert (section.method, section.max_draft_len, section.draft.source) == (
        "draft",
        "auto",
        str(tiny_llama),
    )
    draft_spec = recipe.draft_quant_spec()
    assert draft_spec is not None and (draft_spec.method, draft_spec.weight_bits) == ("none", 16)
    resolved = recipe.resolved()["speculative"]["draft"]["quantization"]
    assert (resolved["method"], resolved["weight_bits"]) == ("none", 16)


def test_a_recipe_without_speculation_resolves_as_before(tmp_path: Path, tiny_llama: Path) -> None:
    path = recipe_file(tmp_path, tiny_llama, "")
    path.write_text(path.read_text().replace("speculative:\n", ""))
    assert "speculative" not in load_recipe(path).resolved()


def test_the_draft_takes_its_own_quantization(tmp_path: Path, tiny_llama: Path) -> None:
    text = f"  draft:\n    source: {tiny_llama}\n    quantization:\n      method: fp8\n"
    spec = load_recipe(recipe_file(tmp_path, tiny_llama, text)).draft_quant_spec()
    assert spec is not None and (spec.method, spec.weight_bits) == ("fp8", 8)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("  colour: blue\n", "speculative.colour: unknown key — allowed keys: method, draft"),
        (
            "  max_draft_len: 0\n  method: ngram\n",
            "speculative.max_draft_len: 0: must be auto or a number of draft tokens from 1 to 16",
        ),
        ("  method: eagle\n", "speculative.method: 'eagle' is not allowed"),
        ("  max_draft_len: 4\n", "speculative: method draft needs a draft model — add draft:"),
        (
            "  method: ngram\n",
            "speculative.max_draft_len: auto measures a draft model; ngram has none",
        ),
        (
            "  method: ngram\n  max_draft_len: 4\n  draft: x\n",
            "speculative.draft: method ngram drafts from the prompt itself",
        ),
        (
            "  draft:\n    source: x\n    quantization:\n      method: awq\n      weight_bits: 8\n",
            "speculative.draft.quantization.weight_bits: awq does not quantise weights to 8 bits",
        ),
        (
            "  draft:\n    source: x\n    size: 3\n",
            "speculative.draft.size: unknown key — allowed keys: source, quantization",
        ),
    ],
)
def test_recipe_errors_name_the_key_and_the_fix(
    tmp_path: Path, tiny_llama: Path, section: str, expected: str
) -> None:
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(recipe_file(tmp_path, tiny_llama, section))
    assert expected in excinfo.value.message


# ---- preflight: the draft is checked before anything runs --------------------------------


def test_a_draft_whose_tokenizer_differs_is_refused_before_calibration(
    tmp_path: Path, tiny_llama: Path, made_draft: tuple[Path, dict]
) -> None:
    wrong = mismatched_copy(made_draft[0], tmp_path / "wrong-draft")
    recipe = recipe_file(tmp_path, tiny_llama, f"  draft: {wrong}\n  max_draft_len: 4\n")
    code, _, stderr = kiln("compile", str(recipe), "--json")
    assert code == 2
    assert "speculative.draft.source: the draft's tokenizer differs from the model's" in stderr
    assert "vocabulary: 512 vs 512 tokens, 1 ids differ (id 2: '<|im_end|>' vs '<|end|>')" in stderr
    assert (
        "special tokens: only the target has ['<|im_end|>'], only the draft has ['<|end|>']"
        in stderr
    )
    assert "make one from the model with `kiln draft`" in stderr
    assert not (tmp_path / "out").exists()  # nothing calibrated, nothing cached


def test_tokenizer_differences_name_merges_and_special_roles(
    tmp_path: Path, tiny_llama: Path
) -> None:
    other = shutil.copytree(tiny_llama, tmp_path / "other")
    data = json.loads((other / "tokenizer.json").read_text())
    data["model"]["merges"] = data["model"]["merges"][1:]
    (other / "tokenizer.json").write_text(json.dumps(data))
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|im_end|>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    facts = [tokenizer_facts(parse_source(str(p), tmp_path)) for p in (tiny_llama, other)]
    differences = tokenizer_differences(facts[0], facts[1])
    assert differences[0].startswith("merges: 253 vs 252, first difference at #0:")
    assert differences[1] == "eos_token: '<|endoftext|>' vs '<|im_end|>'"
    assert tokenizer_differences(facts[0], facts[0]) == []


def test_a_draft_as_large_as_the_model_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = recipe_file(tmp_path, tiny_llama, f"  draft: {tiny_llama}\n  max_draft_len: 4\n")
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "the draft (0M parameters) is not smaller than the model (0M)" in stderr


def test_a_missing_draft_source_is_reported_with_its_key(tmp_path: Path, tiny_llama: Path) -> None:
    recipe = recipe_file(tmp_path, tiny_llama, "  draft: no-such-draft\n  max_draft_len: 4\n")
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "speculative.draft.source: 'no-such-draft': no such file or directory" in stderr


# ---- kiln draft --------------------------------------------------------------------------


def test_kiln_draft_writes_a_loadable_shallow_copy_with_the_targets_tokenizer(
    tiny_llama: Path, made_draft: tuple[Path, dict]
) -> None:
    from transformers import AutoModelForCausalLM

    out, report = made_draft
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_llama / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert len(model.model.layers) == 1
    assert (report["layers"], report["target_layers"], report["distill_steps"]) == (1, 2, 6)
    assert report["parameters"] < report["target_parameters"]
    assert 0 < report["kl_after"] < report["kl_before"]  # distillation moved towards the target
    assert json.loads((out / "kiln-draft.json").read_text()) == report


def test_kiln_draft_reports_acceptance_and_cost_ratio(made_draft: tuple[Path, dict]) -> None:
    acceptance = made_draft[1]["acceptance"]
    assert 0.0 <= acceptance["alpha"] <= 1.0
    assert len(acceptance["alpha_per_position"]) == 4
    assert acceptance["cost_ratio"] > 0 and acceptance["num_drafts"] > 0
    assert acceptance["best_k"] == analytic_best_k(acceptance["alpha"], acceptance["cost_ratio"], 4)


def test_kiln_draft_times_the_speedup_it_reports(made_draft: tuple[Path, dict]) -> None:
    acceptance = made_draft[1]["acceptance"]
    plain, speculative = acceptance["plain_tokens_per_s"], acceptance["speculative_tokens_per_s"]
    assert plain > 0 and speculative > 0
    assert acceptance["measured_speedup"] == pytest.approx(speculative / plain, rel=1e-3)


def test_an_undistilled_draft_keeps_the_targets_first_layer_and_head(
    tmp_path: Path, tiny_llama: Path
) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "cut"
    code, stdout, stderr = kiln(
        "draft",
        str(tiny_llama),
        "--layers",
        "1",
        "--distill-steps",
        "0",
        "--no-measure",
        "--out",
        str(out),
        "--json",
    )
    assert code == 0, stderr
    assert json.loads(stdout)["acceptance"] == {}
    draft, target = (
        load_file(out / "model.safetensors"),
        load_file(tiny_llama / "model.safetensors"),
    )
    assert set(draft) == {k for k in target if ".layers.1." not in k}
    assert all(draft[k].equal(target[k]) for k in draft)


def test_kiln_draft_refuses_as_many_layers_as_the_target(tmp_path: Path, tiny_llama: Path) -> None:
    code, _, stderr = kiln(
        "draft", str(tiny_llama), "--layers", "2", "--no-measure", "--out", str(tmp_path / "d")
    )
    assert code == 2
    assert "--layers 2: a draft keeps 1 to 1 of the target's 2 layers" in stderr


# ---- kiln compile with a draft -----------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, made_draft: tuple[Path, dict]
) -> tuple[Path, Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("compile-spec")
    # A float model: TensorRT-LLM's PyTorch backend, which serves the draft-target YAML,
    # does not load int4 compressed-tensors checkpoints.
    # external_draft_engine: the engine plan for external draft tokens is asked for here.
    section = f"  draft: {made_draft[0]}\n{SMALL_AUTO}{EXTERNAL}"
    recipe = recipe_file(tmp, tiny_llama, section, method="none")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    return recipe, Path(result["artifact"]), result


def test_the_draft_is_a_nested_artifact_that_verifies(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    _, path, result = compiled
    assert {
        "draft-source",
        "draft-quantize",
        "draft-export-tp1",
        "draft-package",
        "acceptance",
    } <= set(result["stages"])
    assert artifact.verify(path) == []
    assert artifact.verify(path / "draft") == []
    nested = artifact.load_manifest(path / "draft")
    assert "draft/model/config.json" in artifact.load_manifest(path).files
    assert nested.scheme.scheme == "NO_QUANT"
    assert (path / "draft" / "trtllm" / "tp1" / "config.json").is_file()
    section = artifact.load_manifest(path).speculative.to_dict()
    assert (section["method"], section["draft"], section["draft_digest"]) == (
        "draft",
        "draft",
        nested.digest,
    )


def test_the_draft_goes_through_the_models_own_pipeline(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    _, path, _ = compiled
    nested = artifact.load_manifest(path / "draft")
    # Stage timings, as the model's own stages have them.
    assert nested.stages["draft-quantize"].seconds > 0
    # Hard links into the cache, as the model's own files are: the draft is not copied.
    quantize_key = nested.stages["draft-quantize"].key
    cached = path.parent / ".kiln-cache" / "draft-quantize" / quantize_key[:24] / "model"
    shipped = path / "draft" / "model" / "model.safetensors"
    assert shipped.samefile(cached / "model.safetensors")


def test_a_pre_quantised_draft_is_converted_as_it_is(
    tmp_path: Path, tiny_llama: Path, made_draft: tuple[Path, dict]
) -> None:
    from tests.prequantized import make_awq_checkpoint

    awq = make_awq_checkpoint(made_draft[0], tmp_path / "awq-draft")
    recipe = recipe_file(tmp_path, tiny_llama, f"  draft: {awq.path}\n  max_draft_len: 2\n")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    nested = artifact.load_manifest(Path(json.loads(stdout)["artifact"]) / "draft")
    assert nested.scheme is not None
    assert (nested.scheme.scheme, nested.scheme.backend) == ("W4A16_AWQ", "import")


def test_auto_measures_alpha_and_c_and_records_the_optimal_k(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    section = artifact.load_manifest(compiled[1]).speculative.to_dict()
    assert section["chosen_by"] == "auto"
    assert 0.0 <= section["alpha"] <= 1.0 and len(section["alpha_per_position"]) == 4
    assert section["cost_ratio"] > 0 and section["num_drafts"] > 0
    assert section["measured_on"]["device"] == "cpu" and section["measured_on"]["prompts"] == 2
    assert section["max_draft_len"] == analytic_best_k(section["alpha"], section["cost_ratio"], 4)
    assert section["expected_speedup"] > 0  # the formula's, kept for comparison


def test_auto_decides_whether_speculation_pays_from_a_timed_run(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    section = artifact.load_manifest(compiled[1]).speculative.to_dict()
    plain, speculative = section["plain_tokens_per_s"], section["speculative_tokens_per_s"]
    assert plain > 0 and speculative > 0
    assert section["measured_speedup"] == pytest.approx(speculative / plain, rel=1e-3)
    assert section["pays"] == (
        section["measured_speedup"] > 1
    )  # the clock's word, not the formula's
    assert section["measured_on"]["timed_prompts"] == 2 and section["measured_on"]["name"]


def test_build_plan_and_serve_yaml_carry_the_draft_and_k(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    path = compiled[1]
    manifest = artifact.load_manifest(path)
    k = manifest.speculative.to_dict()["max_draft_len"]
    target, draft = manifest.targets["h100-sxm"].build.commands
    assert target.endswith(f"--speculative_decoding_mode draft_tokens_external --max_draft_len {k}")
    assert "--checkpoint_dir draft/trtllm/tp1 --output_dir engines/h100-sxm/draft-engine" in draft
    assert "--speculative_decoding_mode" not in draft
    assert draft in (path / "engines" / "h100-sxm" / "build.sh").read_text()
    serve = path / "engines" / "h100-sxm" / "trtllm-serve.yaml"
    options = yaml.safe_load(serve.read_text())
    assert options["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": k,
        "speculative_model_dir": "draft/model",
    }
    assert options["disable_overlap_scheduler"] is True
    assert (path / options["speculative_config"]["speculative_model_dir"] / "config.json").is_file()
    assert serve.read_text().startswith("# from the artifact directory: trtllm-serve model ")


def test_inspect_shows_the_speculative_section(compiled: tuple[Path, Path, dict[str, Any]]) -> None:
    path = compiled[1]
    k = artifact.load_manifest(path).speculative.to_dict()["max_draft_len"]
    code, stdout, _ = kiln("inspect", str(path))
    assert code == 0
    assert f"K={k} (auto)" in stdout and "cost ratio c" in stdout
    code, stdout, _ = kiln("inspect", str(path), "--json")
    assert json.loads(stdout)["speculative"]["max_draft_len"] == k


def test_a_rerun_with_a_draft_is_a_no_op(compiled: tuple[Path, Path, dict[str, Any]]) -> None:
    recipe, path, _ = compiled
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    again = json.loads(stdout)
    assert again["up_to_date"] is True and again["artifact"] == str(path)


def test_the_runtime_turns_speculation_on_from_the_artifact(
    compiled: tuple[Path, Path, dict[str, Any]],
) -> None:
    from kiln.runtime.engine.core import Engine

    path = compiled[1]
    entry = artifact.load_manifest(path).speculative.to_dict()
    # A draft measured slower than plain decoding stays off unless asked for.
    default = Engine.from_artifact(path)
    assert (default.speculator is not None) == entry["pays"]
    engine = Engine.from_artifact(path, speculative=True)
    assert engine.speculator is not None and engine.speculator.proposer is not None
    assert engine.speculator.config.num_speculative_tokens == entry["max_draft_len"]


def test_ngram_speculation_builds_only_the_target_and_serves_ngram(
    tmp_path: Path, tiny_llama: Path, caplog: pytest.LogCaptureFixture
) -> None:
    section = f"  method: ngram\n  max_draft_len: 3\n  max_matching_ngram_size: 2\n{EXTERNAL}"
    recipe = recipe_file(tmp_path, tiny_llama, section, method="none")
    with caplog.at_level(logging.WARNING, logger="kiln.compiler.trtllm.deploy"):
        code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert "trtllm-serve and the LLM API run DraftTarget and NGram on the PyTorch" in caplog.text
    assert code == 0, stderr
    path = Path(json.loads(stdout)["artifact"])
    manifest = artifact.load_manifest(path)
    assert manifest.speculative.to_dict() == {
        "method": "ngram",
        "max_draft_len": 3,
        "chosen_by": "recipe",
        "max_matching_ngram_size": 2,
    }
    assert not (path / "draft").exists()
    (command,) = manifest.targets["h100-sxm"].build.commands
    assert command.endswith("--speculative_decoding_mode draft_tokens_external --max_draft_len 3")
    options = yaml.safe_load((path / "engines" / "h100-sxm" / "trtllm-serve.yaml").read_text())
    assert options["speculative_config"] == {
        "decoding_type": "NGram",
        "max_draft_len": 3,
        "max_matching_ngram_size": 2,
    }


def test_by_default_trtllm_serve_speculates_and_the_engine_decodes_plainly(
    tmp_path: Path, tiny_llama: Path
) -> None:
    section = "  method: ngram\n  max_draft_len: 3\n  max_matching_ngram_size: 2\n"
    recipe = recipe_file(tmp_path, tiny_llama, section, method="none")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    path = Path(json.loads(stdout)["artifact"])
    target = artifact.load_manifest(path).targets["h100-sxm"]
    assert (target.engine, target.pytorch) == ("planned", "ready")
    (command,) = target.build.commands
    assert "--speculative_decoding_mode" not in command and "--max_draft_len" not in command
    script = (path / "engines" / "h100-sxm" / "build.sh").read_text()
    assert "# note: plain decoding: speculative decoding is served by trtllm-serve.yaml" in script
    options = yaml.safe_load((path / "engines" / "h100-sxm" / "trtllm-serve.yaml").read_text())
    assert options["speculative_config"]["decoding_type"] == "NGram"


def test_validate_refuses_speculation_that_only_an_engine_would_serve(
    tmp_path: Path, tiny_llama: Path
) -> None:
    engine_only = "  method: ngram\n  max_draft_len: 3\n{}deploy:\n  trtllm_path: engine\n"
    recipe = recipe_file(tmp_path, tiny_llama, engine_only.format(""), method="none")
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "nothing would speculate" in stderr and "PyTorch backend only" in stderr
    assert "external_draft_engine: true" in stderr
    opted = recipe_file(tmp_path, tiny_llama, engine_only.format(EXTERNAL), method="none", name="o")
    code, _, stderr = kiln("validate", str(opted))
    assert code == 0, stderr


def test_an_llm_compressor_fp8_draft_is_served_from_its_modelopt_conversion(
    tmp_path: Path, made_draft: tuple[Path, dict], tiny_llama: Path
) -> None:
    from kiln.compiler.trtllm.rules.pytorch import check_hf_checkpoint

    section = (
        f"  draft:\n    source: {made_draft[0]}\n    quantization:\n      method: fp8\n"
        "      activations: fp8_static\n  max_draft_len: 2\n"
    )
    recipe = recipe_file(tmp_path, tiny_llama, section, method="none")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["targets"]["h100-sxm"]["pytorch"] == "ready"
    path = Path(result["artifact"])
    options = yaml.safe_load((path / "engines" / "h100-sxm" / "trtllm-serve.yaml").read_text())
    assert options["speculative_config"]["speculative_model_dir"] == "trtllm/hf-draft"
    assert check_hf_checkpoint(path / "trtllm" / "hf-draft", 1) == []
    assert artifact.verify(path) == []
