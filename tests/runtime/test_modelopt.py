"""ModelOpt HF exports served by the runtime, against the exported model as
`quant.backends.modelopt.load_checkpoint` rebuilds it: its dequantised codes, with the exported
pre-quant, activation and KV-cache scales applied by hooks, which is what the checkpoint ships.

Each served linear computes what the exported model's does on the same input: exactly for
FP8 and int8 (the same codes times the same scales), to bf16 precision for int4 (the int4pack
CPU kernel takes bf16 activations). End to end, as in test_quantized.py:
- W4A16 AWQ: bf16 activations in every layer: max |delta logprob| 0.05, mean 0.02.
- W8A8 SmoothQuant and FP8, static activation scales (and an FP8 KV cache): rounding of
  activations and cached keys is discontinuous, and norms, RoPE and attention are computed
  in another order than transformers does, so now and then a value lands on the other side
  of a rounding step (with the FP8 KV cache, a flipped key moves every later position; the
  reference itself moves by max 0.05, mean 0.01 when its embeddings change by 1e-5):
  max 0.1, mean 0.02.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kiln.quant import quantize
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.errors import ArtifactError
from kiln.runtime.kernels import Fp8Linear, Int4Linear, Int8Linear
from kiln.runtime.linear import PreScaledLinear
from tests.runtime.conftest import PROMPTS, hf_logprobs, logprobs_of

CALIBRATION = CalibrationSpec(dataset="builtin:licenses", num_samples=8, max_seq_len=64)
SPECS = {
    "fp8_kv_fp8": QuantSpec(
        method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8", backend="modelopt"
    ),
    "awq_w4a16": QuantSpec(method="awq", weight_bits=4, group_size=64, backend="modelopt"),
    "smoothquant": QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_static", backend="modelopt"
    ),
    "awq_w4a8": QuantSpec(
        method="awq", weight_bits=4, group_size=64, activations="fp8_static", backend="modelopt"
    ),
}
# mode → (qkv layer, o_proj layer, KV cache, (max, mean) |delta logprob|)
SERVED = {
    "fp8_kv_fp8": (Fp8Linear, Fp8Linear, "fp8", (0.1, 0.02)),
    "awq_w4a16": (Int4Linear, PreScaledLinear, None, (0.05, 0.02)),
    "smoothquant": (PreScaledLinear, PreScaledLinear, None, (0.1, 0.02)),
}


@pytest.fixture(scope="module")
def exported(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """mode → tiny_llama quantised with ModelOpt and exported as a HF checkpoint (made once)."""
    pytest.importorskip("modelopt")
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            out = tmp_path_factory.mktemp(f"modelopt-{mode}")
            quantize(tiny_llama, SPECS[mode], CALIBRATION, out)
            made[mode] = out
        return made[mode]

    return get


@pytest.mark.parametrize("mode", list(SERVED))
def test_served_modelopt_export_matches_the_exported_model(
    mode: str, exported: Callable[[str], Path]
) -> None:
    from kiln.quant.backends.modelopt import load_checkpoint

    model_dir = exported(mode)
    engine = Engine.from_pretrained(model_dir)
    qkv, o_proj, kv_cache, (max_tol, mean_tol) = SERVED[mode]
    layer = engine.model.layers[0]
    assert isinstance(layer.qkv, qkv) and isinstance(layer.o_proj, o_proj)
    if mode == "smoothquant":
        assert isinstance(layer.o_proj, PreScaledLinear)
        assert isinstance(layer.o_proj.inner, Int8Linear)
    assert engine.runner.cache.quant == kv_cache
    reference, _ = load_checkpoint(model_dir)
    prompt = engine.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    )[0]
    assert out.prompt_logprobs is not None
    ours = logprobs_of(out.prompt_logprobs[1:], prompt[1:])
    theirs = hf_logprobs(reference, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    delta = (ours - theirs).abs()
    assert delta.max() <= max_tol and delta.mean() <= mean_tol, (delta.max(), delta.mean())
    # Each greedy token is the reference's choice or within max_tol of it (a near-tie).
    continued = hf_logprobs(reference, prompt + out.token_ids)[len(prompt) - 1 : -1]
    chosen = continued[torch.arange(16), torch.tensor(out.token_ids)]
    assert (continued.max(dim=-1).values - chosen).max() <= max_tol


@pytest.mark.parametrize("mode", list(SERVED))
def test_each_served_linear_computes_what_the_exported_model_does(
    mode: str, exported: Callable[[str], Path]
) -> None:
    from kiln.quant.backends.modelopt import load_checkpoint

    model_dir = exported(mode)
    ours = Engine.from_pretrained(model_dir).model.layers[0]
    reference, _ = load_checkpoint(model_dir)
    layer = reference.model.layers[0]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    tolerance = 1e-2 if mode == "awq_w4a16" else 1e-5
    with torch.no_grad():  # the reference's hooks apply its pre-quant and activation scales
        pairs = [
            (ours.gate_up(x), torch.cat([layer.mlp.gate_proj(x), layer.mlp.up_proj(x)], -1)),
            (ours.o_proj(x), layer.self_attn.o_proj(x)),
        ]
    for got, expected in pairs:
        assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_unserved_modelopt_scheme_is_refused_naming_what_is_served(
    exported: Callable[[str], Path],
) -> None:
    model_dir = exported("awq_w4a8")
    with pytest.raises(ArtifactError) as err:
        Engine.from_pretrained(model_dir)
    message = err.value.message
    assert str(model_dir) in message and "W4A8_AWQ" in message
    assert "FP8, W4A16_AWQ, W8A8_SQ_PER_CHANNEL" in message
