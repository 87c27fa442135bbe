"""ModelOpt HF exports served by kiln's runtime, against the exported model as
`quant.backends.modelopt.load_checkpoint` rebuilds it: its dequantised codes, with the exported
pre-quant, activation and KV-cache scales applied by hooks, which is what the checkpoint ships
(test_backends proves those values are the calibrated model's).

Each served linear computes what the exported model's does on the same input: exactly for
FP8 and int8 (the same codes times the same scales), to bf16 precision for int4 (the int4pack
CPU kernel takes bf16 activations). End to end, in the style of tests/runtime/test_quantized.py:
- W4A16 AWQ: bf16 activations in every layer: max |delta logprob| 0.05, mean 0.02.
- W8A8 SmoothQuant and FP8, static activation scales (and an FP8 KV cache): rounding of
  activations and cached keys is discontinuous, and norms, RoPE and attention are computed
  in another order than transformers does, so now and then a value lands on the other side
  of a rounding step (with the FP8 KV cache, a flipped key moves every later position; the
  reference itself moves by max 0.05, mean 0.01 when its embeddings change by 1e-5):
  max 0.1, mean 0.02.
"""

from __future__ import annotations

import pytest
import torch

from kiln.quant.backends.modelopt import load_checkpoint
from kiln.runtime import Engine
from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.engine.layers.fp8 import Fp8Linear
from kiln.runtime.engine.layers.int4 import Int4Linear
from kiln.runtime.engine.layers.int8 import Int8Linear
from kiln.runtime.engine.layers.linear import PreScaledLinear
from tests.quant.conftest import Quantised
from tests.runtime.conftest import assert_close_to_reference

# tests/quant/conftest.py key → (qkv layer, o_proj layer, KV cache, (max, mean) |delta|)
SERVED = {
    "modelopt-fp8-kv_fp8": (Fp8Linear, Fp8Linear, "fp8", (0.1, 0.02)),
    "modelopt-awq-w4-g64": (Int4Linear, PreScaledLinear, None, (0.05, 0.02)),
    "modelopt-smoothquant-static": (PreScaledLinear, PreScaledLinear, None, (0.1, 0.02)),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # two shared cores: as the runtime tests run


@pytest.mark.parametrize("key", list(SERVED))
def test_served_modelopt_export_matches_the_exported_model(key: str, quantised: Quantised) -> None:
    model_dir, _ = quantised(key)
    engine = Engine.from_pretrained(model_dir)
    qkv, o_proj, kv_cache, (max_tol, mean_tol) = SERVED[key]
    layer = engine.model.layers[0]
    assert isinstance(layer.qkv, qkv) and isinstance(layer.o_proj, o_proj)
    if key == "modelopt-smoothquant-static":  # int8 x int8 behind the SmoothQuant scale
        assert isinstance(layer.o_proj, PreScaledLinear)
        assert isinstance(layer.o_proj.inner, Int8Linear)
    assert engine.runner.cache.quant == kv_cache
    reference, _ = load_checkpoint(model_dir)
    assert_close_to_reference(engine, reference, max_tol, mean_tol)


@pytest.mark.parametrize("key", list(SERVED))
def test_each_served_linear_computes_what_the_exported_model_does(
    key: str, quantised: Quantised
) -> None:
    model_dir, _ = quantised(key)
    ours = Engine.from_pretrained(model_dir).model.layers[0]
    reference, _ = load_checkpoint(model_dir)
    layer = reference.model.layers[0]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    tolerance = 1e-2 if "awq" in key else 1e-5
    with torch.no_grad():  # the reference's hooks apply its pre-quant and activation scales
        pairs = [
            (ours.gate_up(x), torch.cat([layer.mlp.gate_proj(x), layer.mlp.up_proj(x)], -1)),
            (ours.o_proj(x), layer.self_attn.o_proj(x)),
        ]
    for got, expected in pairs:
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_unserved_modelopt_scheme_is_refused_naming_what_is_served(
    quantised: Quantised, tmp_path
) -> None:
    import json
    import shutil

    model_dir = tmp_path / "int8-kv"  # an INT8 KV cache: read, but not served by ModelOpt's
    shutil.copytree(quantised("modelopt-fp8-kv_fp8")[0], model_dir)
    config = json.loads((model_dir / "hf_quant_config.json").read_text())
    config["quantization"]["kv_cache_quant_algo"] = "INT8"
    (model_dir / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError) as err:
        Engine.from_pretrained(model_dir)
    message = err.value.message
    assert str(model_dir) in message and "int8 KV cache" in message
    assert "FP8, W4A16_AWQ, W8A8_SQ_PER_CHANNEL" in message


def test_modelopt_algorithm_kiln_cannot_read_is_named(quantised: Quantised, tmp_path) -> None:
    import json
    import shutil

    from kiln.runtime.formats.checkpoint import open_checkpoint

    model_dir = tmp_path / "mxfp4"
    shutil.copytree(quantised("modelopt-fp8-kv_fp8")[0], model_dir)
    config = json.loads((model_dir / "hf_quant_config.json").read_text())
    config["quantization"]["quant_algo"] = "W4A8_MXFP4_FP8"
    (model_dir / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError) as err:
        open_checkpoint(model_dir)
    assert str(model_dir) in err.value.message and "'W4A8_MXFP4_FP8'" in err.value.message
    assert "W4A16_AWQ" in err.value.message  # what it does read
