"""W4A8 AWQ (ModelOpt: int4 group weights, static FP8 activations) exported as TensorRT-LLM
1.2's W4A8_AWQ checkpoint: against ModelOpt's own writer, read back, and held to the rules of
compiler/trtllm/rules/checkpoint.py for Llama and Qwen2 at tp 1, 2 and 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint, check_config
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.weights import effective_weight
from tests.compiler.test_compile import kiln
from tests.compiler.test_trtllm_export import max_rel_error
from tests.compiler.test_trtllm_modelopt import (  # noqa: F401
    _compare,
    kept_by_both,
    modelopt_exports,
)
from tests.compiler.trtllm_recipes import compile_conforming, quantised_per_arch, scheme_recipe
from tests.tiny_models import make_tiny_model

W4A8 = QuantSpec(
    method="awq", weight_bits=4, group_size=128, activations="fp8_static", backend="modelopt"
)


def test_w4a8_matches_modelopts_writer_where_both_keep_the_tensors(modelopt_exports):  # noqa: F811
    theirs_dir, ours_dir = modelopt_exports("W4A8_AWQ_BETA_CFG")
    config_o, (ours,) = read_checkpoint(ours_dir)
    config_m, (theirs,) = read_checkpoint(theirs_dir)
    assert config_o["quantization"] == config_m["quantization"]
    assert set(ours) == set(theirs)
    # ModelOpt's HF writer re-smooths gate/up and folds the q/k/v pre-quant scale into the
    # norm (test_trtllm_modelopt); everything else, weights_scaling_factor_2 and the FP8
    # activation scales included, must agree.
    same = kept_by_both(theirs)
    assert any(k.endswith("weights_scaling_factor_2") for k in same)
    _compare(ours, theirs, same, int4=True)
    assert check_checkpoint(ours_dir) == []
    assert check_checkpoint(theirs_dir) == []  # NVIDIA's writer obeys the rules read from TRT-LLM


@pytest.fixture(scope="module")
def w4a8(tmp_path_factory):
    """arch → a tiny model of `arch` (hidden 256, so groups of 128 split over 2 ranks)
    quantised W4A8 AWQ g128 by kiln's ModelOpt backend."""
    models = {
        arch: make_tiny_model(tmp_path_factory.mktemp(f"w4a8-{arch}-model"), arch=arch,
                              hidden_size=256, intermediate_size=512)
        for arch in ("llama", "qwen2")
    }  # fmt: skip
    return quantised_per_arch(tmp_path_factory, models, W4A8, "w4a8")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w4a8_checkpoint_conforms(w4a8, arch, tp, tmp_path):
    try:
        export_checkpoint(w4a8(arch), tmp_path, tp_size=tp)
    except UsageError as exc:  # o_proj's 256 inputs / 4 = 64 cut a group of 128
        assert tp == 4 and "group of 128" in exc.message
        return
    assert check_checkpoint(tmp_path) == []
    config, ranks = read_checkpoint(tmp_path)
    assert config["quantization"]["pre_quant_scale"] is True
    # W4A8's group-wise layer pads features to a multiple of max(128, group) × tp.
    for rank in ranks:
        assert rank["transformer.layers.0.mlp.proj.weight"].shape == (256 // 2, 512 // tp)
        assert rank["transformer.layers.0.mlp.proj.weights_scaling_factor_2"].shape == (1,)


def test_w4a8_decodes_to_the_quantisers_weights(w4a8, tmp_path):
    export_checkpoint(w4a8("llama"), tmp_path)
    decoded = decode_checkpoint(tmp_path)
    ckpt = open_checkpoint(w4a8("llama"))
    for layer in range(2):
        for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            module = f"model.layers.{layer}.{name}"
            want = effective_weight(ckpt.linear(module), torch.float32)
            # group scales are stored in the model's dtype (bf16): < 2^-8 relative
            assert max_rel_error(decoded[f"{module}.weight"], want) < 2**-7, module


def test_w4a8_tp2_shards_reassemble_to_the_tp1_weights(w4a8, tmp_path):
    export_checkpoint(w4a8("qwen2"), tmp_path / "one")
    export_checkpoint(w4a8("qwen2"), tmp_path / "two", tp_size=2)
    one, two = decode_checkpoint(tmp_path / "one"), decode_checkpoint(tmp_path / "two")
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_w4a8_without_pre_quant_scales_is_named():
    config = {
        "num_hidden_layers": 1,
        "quantization": {"quant_algo": "W4A8_AWQ", "group_size": 128, "exclude_modules": []},
    }
    assert any("pre_quant_scale: true" in p for p in check_config(config))


W4A8_RECIPE = {
    "method": "awq",
    "group_size": 128,
    "symmetric": True,
    "activations": "fp8_static",
    "backend": "modelopt",
}


def _recipe(tmp_path: Path, model: Path, target: str, path: str = "both") -> Path:
    return scheme_recipe(tmp_path, model, W4A8_RECIPE, target, path)


@pytest.mark.parametrize("target", ["h100-sxm", "l40s"])
def test_validate_takes_w4a8_for_hopper_and_ada_engines(tmp_path, tiny_llama, target):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target, "engine")))
    assert code == 0, stderr


@pytest.mark.parametrize(("target", "why"), [("b200", "W4A8_AWQ does not run on b200"),
                                             ("a100-80gb", "no FP8 tensor cores")])  # fmt: skip
def test_validate_refuses_w4a8_where_trtllm_has_no_kernels(tmp_path, tiny_llama, target, why):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target, "engine")))
    assert code == 2
    assert why in stderr


def test_validate_refuses_w4a8_in_groups_of_64(tmp_path, tiny_llama):
    """TensorRT-LLM: "W4A8_AWQ with group_size = 64 is not implemented yet!"."""
    recipe = scheme_recipe(tmp_path, tiny_llama, {**W4A8_RECIPE, "group_size": 64}, "h100-sxm")
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "group_size 64" in stderr and "group 128 only for W4A8_AWQ" in stderr


def test_compile_plans_a_w4a8_engine_and_serves_the_modelopt_export(tmp_path, tiny_llama):
    status, artifact = compile_conforming(_recipe(tmp_path, tiny_llama, "h100-sxm"), "h100-sxm")
    assert status == {"engine": "planned", "pytorch": "ready"}
    assert any(artifact.glob("**/rank0.safetensors"))


def test_compile_reports_and_gates_w4a8_on_the_values_that_ship(tmp_path, tiny_llama):
    """The report stage and the gate run the W4A8 export in kiln's runtime (FP8-rounded int4
    weights, FP8 activations: runtime/formats/w4a8.py), so a recipe with `gates:` compiles and
    gates."""
    recipe = yaml.safe_load(_recipe(tmp_path, tiny_llama, "h100-sxm").read_text())
    recipe["gates"] = {  # small enough for the tiny model; no shadow traffic
        "tasks": ["kiln_mc"],
        "limit": 8,
        "divergence": {"num_texts": 2, "max_seq_len": 32, "top_k": 10},
        "thresholds": {},
    }
    path = tmp_path / "gated.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    code, stdout, stderr = kiln("compile", str(path), "--json")
    assert code == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    assert "report" in result["stages"]
    assert result["gate"]["passed"] and result["gate"]["baseline"]["kind"] == "source"
    report = json.loads((Path(result["artifact"]) / "reports" / "quantization.json").read_text())
    assert report["format"] == "modelopt" and report["kl_mean"] > 0
