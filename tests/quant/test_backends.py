"""Each scheme with each backend that supports it, on the tiny Llama: what lands on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.quant.backends import BACKENDS, QuantJob
from kiln.quant.backends.modelopt import calibrate, load_checkpoint
from kiln.quant.calibration import load_texts, tokenize
from kiln.quant.layer_report import load_quantised
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.formats.model_info import with_legacy_rope
from tests.quant.conftest import CALIBRATION, SPECS, Quantised, export_modelopt_awq

Q_PROJ = "model.layers.0.self_attn.q_proj"

F8, I8, I32, U8 = torch.float8_e4m3fn, torch.int8, torch.int32, torch.uint8
# key: (scheme, format or quant_algo, q_proj tensor on disk, its dtype, kv cache recorded)
EXPECTED = {
    "llmcompressor-fp8-kv_fp8": ("FP8", "float-quantized", "weight", F8, True),
    "llmcompressor-fp8_dynamic": ("FP8_DYNAMIC", "float-quantized", "weight", F8, False),
    "llmcompressor-awq-w4-g64-asym": ("W4A16_AWQ", "pack-quantized", "weight_packed", I32, False),
    "llmcompressor-gptq-w4-g64-kv_int8": (
        "W4A16_GPTQ",
        "pack-quantized",
        "weight_packed",
        I32,
        True,
    ),
    "llmcompressor-gptq-w8": ("W8A16", "pack-quantized", "weight_packed", I32, False),
    "llmcompressor-smoothquant-dynamic": ("W8A8_SQ", "int-quantized", "weight", I8, False),
    "llmcompressor-smoothquant-static": ("W8A8_SQ", "int-quantized", "weight", I8, False),
    "modelopt-fp8-kv_fp8": ("FP8", "FP8", "weight", F8, True),
    "modelopt-awq-w4-g64": ("W4A16_AWQ", "W4A16_AWQ", "weight", U8, False),
    "modelopt-smoothquant-static": ("W8A8_SQ", "W8A8_SQ_PER_CHANNEL", "weight", I8, False),
    "modelopt-w4a8-awq-g64": ("W4A8_AWQ", "W4A8_AWQ", "weight", U8, False),
}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118


@pytest.mark.parametrize("key", list(SPECS))
def test_quantize_writes_a_complete_checkpoint(quantised: Quantised, key: str) -> None:
    out, record = quantised(key)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    scheme, _, _, _, _ = EXPECTED[key]
    assert record.scheme == scheme
    assert record.backend == SPECS[key].backend
    assert record.format == BACKENDS[SPECS[key].backend].format
    assert record.seconds > 0
    assert "torch" in record.versions and "transformers" in record.versions
    json.dumps(record.to_dict())  # goes into the manifest as is


@pytest.mark.parametrize("key", [k for k in SPECS if k.startswith("llmcompressor")])
def test_llmcompressor_config_names_the_scheme(quantised: Quantised, key: str) -> None:
    out, _ = quantised(key)
    spec, (_, fmt, _, _, kv) = SPECS[key], EXPECTED[key]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == fmt
    weights = config["config_groups"]["group_0"]["weights"]
    assert weights["num_bits"] == spec.weight_bits
    assert weights["group_size"] == spec.group_size
    assert weights["symmetric"] == spec.symmetric
    assert config["ignore"] == ["lm_head"]
    assert (config["kv_cache_scheme"] is not None) == kv


@pytest.mark.parametrize("key", [k for k in SPECS if k.startswith("modelopt")])
def test_modelopt_config_names_the_algorithm(quantised: Quantised, key: str) -> None:
    out, _ = quantised(key)
    _, algo, _, _, kv = EXPECTED[key]
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["quant_algo"] == algo
    assert hf_quant["kv_cache_quant_algo"] == ("FP8" if kv else None)
    assert "lm_head" in hf_quant["exclude_modules"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"


@pytest.mark.parametrize("key", list(SPECS))
def test_weights_are_low_bit_on_disk(quantised: Quantised, key: str) -> None:
    out, _ = quantised(key)
    _, _, tensor, dtype, kv = EXPECTED[key]
    tensors = _tensors(out)
    q = tensors[f"{Q_PROJ}.{tensor}"]
    assert q.dtype == dtype
    if dtype in (torch.int32, torch.uint8):  # packed: 8 int4 per int32, 2 int4 per byte
        per_word = 8 if dtype == torch.int32 else 2
        bits = 4 if SPECS[key].weight_bits == 4 else 8
        assert q.numel() == 128 * 128 * bits // 4 // per_word
    assert f"{Q_PROJ}.weight_scale" in tensors
    assert tensors["lm_head.weight"].dtype == torch.float32  # ignored, kept float
    kv_names = [k for k in tensors if k.endswith(("k_scale", "v_scale"))]
    assert bool(kv_names) == kv


@pytest.mark.parametrize("backend", ["llmcompressor", "modelopt"])
def test_ignored_linears_stay_float(tiny_llama: Path, tmp_path: Path, backend: str) -> None:
    spec = QuantSpec(
        method="fp8",
        weight_bits=8,
        activations="fp8_static",
        ignore=("lm_head", "down_proj", r"re:.*layers\.1\.self_attn\.q_proj$"),
        backend=backend,
    )
    quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path)
    tensors = _tensors(tmp_path)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"):
        assert tensors[f"{name}.weight"].dtype == torch.float32
        assert f"{name}.weight_scale" not in tensors
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_method_none_copies_the_float_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    record = quantize(tiny_llama, resolve(QuantSpec()), CALIBRATION, tmp_path)
    assert record.scheme == "NO_QUANT" and record.format == "float"
    for src in tiny_llama.iterdir():
        if src.name != "config.json":
            assert (tmp_path / src.name).read_bytes() == src.read_bytes()
    # config.json as the source's, its RoPE also spelled as transformers 4 reads it.
    config = json.loads((tiny_llama / "config.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text()) == with_legacy_rope(config)
    assert "rope_theta" not in config and "rope_theta" in with_legacy_rope(config)


def test_quantize_refuses_before_loading(tiny_llama: Path, tmp_path: Path) -> None:
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=32, backend="modelopt")
    with pytest.raises(PreflightError, match="modelopt cannot produce W4A16_GPTQ"):
        quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path)
    assert not any(tmp_path.iterdir())


# Round trip: the checkpoint transformers (or our ModelOpt reader) loads computes what the
# in-memory quantised model computed.


@pytest.fixture(scope="module")
def calibration_ids(tiny_llama: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return tokenize(load_texts(CALIBRATION), tokenizer, CALIBRATION.max_seq_len)


def _float_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "key",
    [
        "llmcompressor-gptq-w4-g64-kv_int8",
        "llmcompressor-fp8-kv_fp8",
        "llmcompressor-smoothquant-static",
        "llmcompressor-awq-w4-g64-asym",
    ],
)
@torch.no_grad()
def test_compressed_tensors_round_trip_is_exact(
    tiny_llama: Path, tmp_path: Path, calibration_ids: list[list[int]], key: str
) -> None:
    spec = SPECS[key]
    model = _float_model(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    BACKENDS["llmcompressor"].run(
        QuantJob(model, tokenizer, resolve(spec), spec, calibration_ids, tmp_path, lambda _m: None)
    )
    probe = torch.tensor([calibration_ids[0]])
    in_memory = model(probe).logits
    reloaded, _ = load_quantised(tmp_path)
    # Same codes, same scales, same fake-quant forward: identical up to float32 summation order.
    torch.testing.assert_close(reloaded(probe).logits, in_memory, atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", ["modelopt-smoothquant-static", "fp8-no-kv"])
@torch.no_grad()
def test_modelopt_round_trip_matches_the_calibrated_model(
    tiny_llama: Path, tmp_path: Path, calibration_ids: list[list[int]], key: str
) -> None:
    from modelopt.torch.export import export_hf_checkpoint

    spec = SPECS.get(key) or QuantSpec(
        method="fp8", weight_bits=8, activations="fp8_static", backend="modelopt"
    )
    model = _float_model(tiny_llama)
    calibrate(model, resolve(spec), spec, calibration_ids)
    probe = torch.tensor([calibration_ids[0]])
    in_memory = model(probe).logits
    export_hf_checkpoint(model, dtype=torch.float32, export_dir=tmp_path)
    reloaded, _ = load_checkpoint(tmp_path)
    # We dequantise ModelOpt's codes and re-apply its activation scales ourselves; int8
    # rounding ties may fall differently: allow 5e-3 on logits of magnitude ~3.
    torch.testing.assert_close(reloaded(probe).logits, in_memory, atol=5e-3, rtol=0)


@torch.no_grad()
def test_modelopt_awq_weights_dequantise_to_the_calibrated_values(
    tiny_llama: Path, tmp_path: Path, calibration_ids: list[list[int]]
) -> None:
    """o_proj and down_proj keep their own pre_quant_scale in the export, so their
    dequantised codes × pre_quant_scale must equal ModelOpt's fake-quantised weights.
    (q/k/v and gate/up are re-smoothed with a shared scale on export and re-quantised.)"""
    expected = export_modelopt_awq(tiny_llama, "modelopt-awq-w4-g64", calibration_ids, tmp_path)
    _, weights = load_checkpoint(tmp_path)
    for name, weight in expected.items():
        torch.testing.assert_close(weights[name], weight, atol=1e-6, rtol=1e-5)


ONE_PASS = [
    ("tiny_llama", "llmcompressor-fp8-kv_fp8"),
    ("tiny_llama", "fp8-no-kv"),
    ("tiny_qwen3_moe", "llmcompressor-fp8-kv_fp8"),
]


@pytest.mark.parametrize(("model", "key"), ONE_PASS)
def test_fp8_calibrated_in_one_pass_is_the_checkpoint_of_two(
    request: pytest.FixtureRequest, tmp_path: Path, model: str, key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """kiln runs FP8's calibration without oneshot's second pass over each layer (it only
    recomputes the first's outputs where no modifier changes weights): the same bytes as
    oneshot's default, which runs it, for a dense model and a mixture of experts (every
    expert calibrated); GPTQ, AWQ and SmoothQuant keep it."""
    import llmcompressor

    from kiln.quant.backends.llmcompressor import build_recipe, propagates

    source: Path = request.getfixturevalue(model)
    spec = SPECS.get(key) or QuantSpec(method="fp8", weight_bits=8, activations="fp8_static")
    scheme = resolve(spec)
    assert not propagates(build_recipe(scheme, spec))
    for other in ("llmcompressor-gptq-w8", "llmcompressor-awq-w4-g64-asym",
                  "llmcompressor-smoothquant-static"):  # fmt: skip
        assert propagates(build_recipe(resolve(SPECS[other]), SPECS[other]))
    passes: list[object] = []
    default: list[bool] = []  # set: run as oneshot's users do, with the second pass
    real = llmcompressor.oneshot

    def oneshot(**kwargs: object) -> object:
        passes.append(kwargs["propagate_error"])
        return real(**{**kwargs, "propagate_error": True} if default else kwargs)

    monkeypatch.setattr(llmcompressor, "oneshot", oneshot)
    quantize(source, scheme, CALIBRATION, tmp_path / "kiln")
    default.append(True)
    quantize(source, scheme, CALIBRATION, tmp_path / "default")
    assert passes == [False, False]  # kiln asks for one pass
    kiln = sorted((tmp_path / "kiln").glob("*.safetensors"))
    two_passes = sorted((tmp_path / "default").glob("*.safetensors"))
    assert kiln and [p.name for p in kiln] == [p.name for p in two_passes]
    assert [p.read_bytes() for p in kiln] == [p.read_bytes() for p in two_passes]
