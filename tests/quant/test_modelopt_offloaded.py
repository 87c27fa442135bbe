"""ModelOpt calibrating a model whose decoder layers accelerate keeps on disk: the layers stay
there, a layer at a time in memory, unless the calibration changes a weight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.utils.offload import PrefixedDataset

from kiln.quant.backends.modelopt import calibrate, load_offloaded
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec

FP8 = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", backend="modelopt")
SAMPLES = [[(7 * i + j) % 500 for j in range(24)] for i in range(3)]


@pytest.fixture
def offloaded(tiny_llama: Path, tmp_path: Path) -> Any:
    return load_offloaded(tiny_llama, torch.float32, tmp_path / "offload", resolve(FP8))


def _held_in_memory(model: Any) -> dict[str, torch.Tensor]:
    """The weights accelerate's loaders hold in memory for the disk-offloaded layers."""
    held: dict[str, torch.Tensor] = {}
    for module in model.modules():
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if isinstance(weights, PrefixedDataset):
            held.update(weights.dataset.state_dict)
    return held


@torch.no_grad()
def test_calibrating_leaves_the_offloaded_layers_on_disk(offloaded: Any) -> None:
    q_proj = offloaded.model.layers[0].self_attn.q_proj
    assert q_proj.weight.is_meta
    calibrate(offloaded, resolve(FP8), FP8, SAMPLES)
    assert q_proj.weight_quantizer.amax is not None  # calibrated, from the weight on disk
    assert _held_in_memory(offloaded) == {}
    assert q_proj.weight.is_meta


def test_a_weight_the_calibration_changes_is_kept(offloaded: Any) -> None:
    from modelopt.torch.quantization.utils.core_utils import enable_weight_access_and_writeback

    q_proj = offloaded.model.layers[0].self_attn.q_proj
    with enable_weight_access_and_writeback(q_proj, offloaded):
        original = q_proj.weight.detach().clone()
        q_proj.weight.data.mul_(2)  # as a calibration that smooths or re-quantises would
    assert set(_held_in_memory(offloaded)) == {"model.layers.0.self_attn.q_proj.weight"}
    with enable_weight_access_and_writeback(q_proj, offloaded, writeback=False):
        torch.testing.assert_close(q_proj.weight, original * 2, atol=0, rtol=0)


def test_the_schemes_declared_whole_are_those_calibrated_beyond_max() -> None:
    """What `kiln plan` estimates (a layer, or the model) is what load_offloaded does."""
    import modelopt.torch.quantization as mtq

    from kiln.quant.backends.base import BACKENDS
    from kiln.quant.backends.modelopt import PRESETS

    beyond_max = {n for n, p in PRESETS.items() if getattr(mtq, p).get("algorithm") != "max"}
    backend = BACKENDS["modelopt"]
    assert backend.loads_whole == beyond_max
    assert backend.offloads_for("FP8") and not backend.offloads_for("W4A16_AWQ")
    assert BACKENDS["llmcompressor"].offloads_for("W4A16_AWQ")
