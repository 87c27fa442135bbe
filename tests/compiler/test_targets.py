"""GPU target profiles and the TensorRT-LLM quantisation × GPU support matrix."""

from __future__ import annotations

import json

import pytest

from kiln.compiler.preflight import run_preflight
from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import load_recipe
from kiln.compiler.trtllm.rules.support import check_algos, check_target
from kiln.compiler.trtllm.targets import PROFILES, TargetProfile, get_profile
from kiln.quant.schemes import Problem, resolve
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import UsageError

FP8 = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static")
FP8_DYNAMIC = QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic")
AWQ = QuantSpec(method="awq", weight_bits=4, group_size=128, symmetric=False)
GPTQ = QuantSpec(method="gptq", weight_bits=4, group_size=128)
SMOOTHQUANT = QuantSpec(method="smoothquant", weight_bits=8, activations="int8_dynamic")


def test_registry_holds_the_required_gpus_under_their_own_names():
    required = {"h100-sxm", "h100-nvl", "h200", "b200", "gb200", "l40s", "a100-80gb"}
    assert required | {"rtx-6000-ada"} <= set(PROFILES)
    assert all(name == profile.name for name, profile in PROFILES.items())


def test_get_profile_names_the_known_targets_when_asked_for_an_unknown_one():
    assert get_profile("h200").marketing_name.startswith("NVIDIA H200")
    with pytest.raises(UsageError) as err:
        get_profile("h300")
    assert "h300" in err.value.message and "h100-sxm" in err.value.message


@pytest.mark.parametrize(
    ("name", "sm", "architecture"),
    [("a100-80gb", "sm80", "Ampere"), ("l40s", "sm89", "Ada Lovelace"),
     ("h100-sxm", "sm90", "Hopper"), ("b200", "sm100", "Blackwell")],
)  # fmt: skip
def test_compute_capability_gives_the_sm_name_and_architecture(name, sm, architecture):
    assert (get_profile(name).sm, get_profile(name).architecture) == (sm, architecture)


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_driver_memory_lies_between_the_decimal_and_binary_reading_of_the_label(profile):
    # "80GB" parts expose up to 80 GiB; none exposes less than 98% of 80e9 bytes.
    assert 0.98 * profile.memory_gb * 1e9 <= profile.memory_bytes <= profile.memory_gb * 2**30


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_dense_throughput_doubles_with_each_halving_of_precision(profile):
    # Within datasheet rounding: the L40S lists 362.05 BF16 and 733 FP8 TFLOPS.
    if profile.fp8_tflops is not None:
        assert profile.fp8_tflops == pytest.approx(2 * profile.bf16_tflops, rel=0.015)
    if profile.fp4_tflops is not None:
        assert profile.fp4_tflops == pytest.approx(2 * profile.fp8_tflops, rel=0.015)


def test_only_parts_with_fp8_tensor_cores_list_fp8_tflops():
    for profile in PROFILES.values():
        assert (profile.fp8_tflops is not None) == (profile.compute_capability >= (8, 9))
        assert (profile.fp4_tflops is not None) == (profile.compute_capability[0] >= 10)


def test_nvlink_parts_are_the_sxm_and_nvl_ones():
    linked = {name for name, p in PROFILES.items() if p.nvlink}
    assert {"h100-sxm", "h100-nvl", "h200", "b200", "gb200", "a100-80gb"} <= linked
    assert not linked & {"l40s", "l4", "rtx-6000-ada", "h100-pcie"}


def test_hopper_runs_fp8_on_both_paths_and_nvfp4_on_neither():
    h100 = get_profile("h100-sxm")
    for path in ("engine", "pytorch"):
        assert "FP8" in h100.quant_algos(path)
        assert "NVFP4" not in h100.quant_algos(path)


def test_blackwell_pytorch_path_has_no_int4_weight_only_nor_w4a8():
    pytorch = get_profile("b200").quant_algos("pytorch")
    assert {"NVFP4", "FP8"} <= pytorch
    assert not {"W4A16_AWQ", "W4A16_GPTQ", "W4A8_AWQ"} & pytorch


def test_ampere_has_no_fp8_compute_but_keeps_an_fp8_kv_cache():
    a100 = get_profile("a100-80gb")
    for path in ("engine", "pytorch"):
        assert not {"FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W4A8_AWQ"} & a100.quant_algos(path)
        assert "FP8" in a100.kv_cache_algos(path)
        assert {"W4A16_AWQ", "W4A16_GPTQ"} <= a100.quant_algos(path)


def test_int8_smoothquant_and_int8_kv_cache_are_engine_path_only():
    for profile in PROFILES.values():
        assert "W8A8_SQ_PER_CHANNEL" not in profile.quant_algos("pytorch")
        assert "INT8" not in profile.kv_cache_algos("pytorch")
    assert "W8A8_SQ_PER_CHANNEL" in get_profile("a100-80gb").quant_algos("engine")
    assert "INT8" in get_profile("h100-sxm").kv_cache_algos("engine")


def test_fp8_rowwise_runs_on_hopper_for_both_paths_and_not_on_blackwell():
    assert "FP8_PER_CHANNEL_PER_TOKEN" in get_profile("h100-sxm").quant_algos("pytorch")
    assert "FP8_PER_CHANNEL_PER_TOKEN" in get_profile("l40s").quant_algos("engine")
    assert "FP8_PER_CHANNEL_PER_TOKEN" not in get_profile("l40s").quant_algos("pytorch")
    for path in ("engine", "pytorch"):
        assert "FP8_PER_CHANNEL_PER_TOKEN" not in get_profile("b200").quant_algos(path)


def test_a_new_gpu_is_one_entry_and_takes_its_family_support():
    rtx_pro = TargetProfile("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 96,
                            97887, 1792, 500.0, 1000.0, 2000.0, None)  # fmt: skip
    assert rtx_pro.sm == "sm120"
    assert "NVFP4" in rtx_pro.quant_algos("pytorch")
    assert "W4A16_AWQ" not in rtx_pro.quant_algos("pytorch")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (QuantSpec(), ("NO_QUANT", None)),
        (FP8, ("FP8", None)),
        (QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8"),
         ("FP8", "FP8")),
        (FP8_DYNAMIC, ("FP8_PER_CHANNEL_PER_TOKEN", None)),
        (AWQ, ("W4A16_AWQ", None)),
        (QuantSpec(method="awq", weight_bits=4, group_size=128, activations="fp8_static"),
         ("W4A8_AWQ", None)),
        (GPTQ, ("W4A16_GPTQ", None)),
        (QuantSpec(method="gptq", weight_bits=4, group_size=None), ("W4A16", None)),
        (QuantSpec(method="gptq", weight_bits=8), ("W8A16", None)),
        (QuantSpec(method="gptq", weight_bits=8, group_size=128), ("W8A16_GPTQ", None)),
        (SMOOTHQUANT, ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", None)),
        (QuantSpec(method="smoothquant", weight_bits=8, activations="int8_static",
                   kv_cache="int8"), ("W8A8_SQ_PER_CHANNEL", "INT8")),
    ],
)  # fmt: skip
def test_quant_spec_maps_to_trtllm_quant_algo_and_kv_cache_algo(spec, expected):
    scheme = resolve(spec)
    assert (scheme.trtllm_quant_algo, scheme.trtllm_kv_cache_quant_algo) == expected


def test_fp8_on_a100_says_why_and_what_would_work():
    problems = check_target(resolve(FP8), "a100-80gb")
    assert len(problems) == 1 and isinstance(problems[0], Problem)
    problem = problems[0]
    assert problem.key == "quantization.method"
    assert "sm80" in problem.problem and "no FP8 tensor cores" in problem.problem
    assert "W4A16" in problem.allowed and "W8A16" in problem.allowed
    assert "kv_cache: fp8" in problem.allowed and "target h100-sxm" in problem.allowed


def test_fp8_kv_cache_alone_runs_on_ampere():
    assert check_target(resolve(QuantSpec(method="gptq", weight_bits=4, group_size=128,
                                  kv_cache="fp8")), "a100-80gb") == []  # fmt: skip


def test_nvfp4_on_hopper_points_to_blackwell():
    (problem,) = check_algos("NVFP4", None, get_profile("h100-sxm"))
    assert "no FP4 tensor cores" in problem.problem and "target b200" in problem.allowed


def test_awq_on_b200_fails_on_both_paths():
    # The PyTorch backend has no INT4 weight-only kernels on sm100, and trtllm-build refuses
    # weight-only schemes on SM 100-119 (tensorrt_llm/builder.py).
    (problem,) = check_target(resolve(AWQ), "b200", path="pytorch")
    assert "PyTorch" in problem.problem and "sm100" in problem.problem
    assert "FP8 (method: fp8)" in problem.allowed and "NVFP4" in problem.allowed
    (engine,) = check_target(resolve(AWQ), "b200", path="engine")
    assert "engine path" in engine.problem
    assert len(check_target(resolve(AWQ), "b200")) == 1


def test_smoothquant_needs_the_engine_path():
    assert check_target(resolve(SMOOTHQUANT), "h100-sxm", path="engine") == []
    (problem,) = check_target(resolve(SMOOTHQUANT), "h100-sxm", path="pytorch")
    assert "SmoothQuant" in problem.problem and "engines" in problem.problem


def test_int8_kv_cache_on_the_pytorch_path_is_a_kv_cache_problem():
    spec = QuantSpec(method="smoothquant", weight_bits=8, activations="int8_static",
                     kv_cache="int8")  # fmt: skip
    assert check_target(resolve(spec), "l40s", path="engine") == []
    problems = check_target(resolve(spec), "l40s", path="pytorch")
    kv = [p for p in problems if p.key == "quantization.kv_cache"]
    assert len(kv) == 1 and "INT8" in kv[0].problem and "fp8" in kv[0].allowed


def test_fp8_with_fp8_kv_cache_runs_everywhere_from_ada_on():
    spec = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8")
    for name, profile in PROFILES.items():
        assert (check_target(resolve(spec), name) == []) == (
            profile.compute_capability >= (8, 9)
        ), name


def test_unknown_target_is_a_problem_listing_the_known_ones():
    (problem,) = check_target(resolve(FP8), "tpu-v5")
    assert problem.key == "targets" and "h200" in problem.allowed


def test_unknown_path_is_a_usage_error():
    with pytest.raises(UsageError):
        check_target(resolve(FP8), "h100-sxm", path="tensorrt")


def test_spec_without_a_trtllm_scheme_is_reported_not_raised(tmp_path, tiny_llama):
    # check_target takes a resolved scheme; a spec that resolves to none is preflight's to
    # report, per target, beside the quantization problem itself.
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: no-scheme\nmodel:\n  source: {tiny_llama}\nquantization:\n  method: awq\n"
        "  activations: int8_dynamic\ntargets: [h100-sxm]\n"
    )
    with pytest.raises(RecipeError) as raised:
        run_preflight(load_recipe(recipe))
    (problem,) = [p for p in raised.value.problems if "h100-sxm" in p]
    assert "targets.0: cannot check h100-sxm" in problem


def test_profile_to_dict_is_json_with_the_support_matrix():
    data = json.loads(json.dumps(get_profile("h100-sxm").to_dict()))
    assert data["sm"] == "sm90" and data["memory_mib"] == 81559
    assert "FP8" in data["pytorch_quant_algos"] and "INT8" in data["engine_kv_cache_algos"]
