"""Our export of a ModelOpt HF checkpoint against ModelOpt's own TensorRT-LLM export.

One ModelOpt-quantised model is written twice by ModelOpt (`export_hf_checkpoint`, and
`export_tensorrt_llm_checkpoint`, NVIDIA's writer of the format); we export the HF copy
and compare tensor by tensor. ModelOpt's two writers round a few codes differently (its
TensorRT-LLM writer re-quantises from float16 weights), so codes may differ by one step in
under 1% of elements; scales must be identical. For AWQ its HF writer also re-smooths
gate/up to one shared pre-quant scale and folds the q/k/v and gate/up pre-quant scales into
the norms, so those tensors are compared only where both writers keep them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.runtime.formats.checkpoint.modelopt import unpack_int4_rows


def _calibration(tokenizer) -> list[torch.Tensor]:
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    return [ids[i * 64 : (i + 1) * 64][None] for i in range(8)]


@pytest.fixture(scope="module")
def modelopt_exports(tiny_llama: Path, tmp_path_factory) -> Callable[[str], tuple[Path, Path]]:
    """preset → (ModelOpt's TensorRT-LLM checkpoint, our export of ModelOpt's HF checkpoint)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batches = _calibration(AutoTokenizer.from_pretrained(tiny_llama))
    made: dict[str, tuple[Path, Path]] = {}

    def get(preset: str) -> tuple[Path, Path]:
        if preset not in made:
            cfg = copy.deepcopy(getattr(mtq, preset.removesuffix("+KV")))
            if preset.endswith("+KV"):
                kv = {"num_bits": (4, 3), "axis": None}
                cfg["quant_cfg"].append(
                    {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": kv, "enable": True}
                )
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            mtq.quantize(model, cfg, lambda m: [m(b) for b in batches])
            root = tmp_path_factory.mktemp(preset.replace("+", "-"))
            with torch.no_grad():
                export_tensorrt_llm_checkpoint(
                    model,
                    "llama",
                    torch.float16,
                    export_dir=root / "modelopt",
                    inference_tensor_parallel=1,
                )
                export_hf_checkpoint(model, dtype=torch.float16, export_dir=root / "hf")
            export_checkpoint(root / "hf", root / "ours", dtype="float16")
            made[preset] = (root / "modelopt", root / "ours")
        return made[preset]

    return get


def _codes(t: torch.Tensor, int4: bool) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).to(torch.int16)
    return (unpack_int4_rows(t) if int4 else t).to(torch.int16)


def _compare(ours: dict, theirs: dict, names: list[str], int4: bool = False) -> None:
    for name in names:
        a, b = ours[name], theirs[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        if name.endswith(".weight") and a.dtype in (torch.int8, torch.float8_e4m3fn):
            differ = _codes(a, int4) != _codes(b, int4)
            assert differ.float().mean() < 0.01, name
            if a.dtype == torch.float8_e4m3fn:  # one FP8 step at most
                close = (a.float() - b.float()).abs() <= b.float().abs() * 2**-3 + 2**-9
                assert bool(close.all()), name
            else:
                assert int((_codes(a, int4) - _codes(b, int4)).abs().max()) <= 1, name
        else:
            assert torch.equal(a, b), name


def kept_by_both(theirs: dict) -> list[str]:
    """Tensors of an AWQ checkpoint both writers keep as they are: not the re-smoothed
    gate/up, nor the norms and q/k/v pre-quant scales the HF writer folds together."""
    return sorted(
        k
        for k in theirs
        if ".mlp.fc." not in k
        and ".mlp.gate." not in k
        and "layernorm" not in k
        and not k.endswith("qkv.prequant_scaling_factor")
    )


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "INT8_SMOOTHQUANT_CFG"])
def test_fp8_and_smoothquant_match_modelopts_writer(preset, modelopt_exports):
    theirs_dir, ours_dir = modelopt_exports(preset)
    config_o, (ours,) = read_checkpoint(ours_dir)
    config_m, (theirs,) = read_checkpoint(theirs_dir)
    assert config_o["quantization"] == config_m["quantization"]
    assert set(ours) == set(theirs)
    _compare(ours, theirs, sorted(theirs))


def test_fp8_kv_cache_scale_is_the_hf_export_scale(modelopt_exports):
    theirs_dir, ours_dir = modelopt_exports("FP8_DEFAULT_CFG+KV")
    config_o, (ours,) = read_checkpoint(ours_dir)
    config_m, (theirs,) = read_checkpoint(theirs_dir)
    assert config_o["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert config_m["quantization"]["kv_cache_quant_algo"] == "FP8"
    # ModelOpt's TensorRT-LLM writer also keeps k/v_cache_scaling_factor, which trtllm-build
    # merges into kv_cache_scaling_factor; ours writes the merged one (the HF export's value).
    extra = {
        k for k in theirs if k.endswith((".k_cache_scaling_factor", ".v_cache_scaling_factor"))
    }
    assert set(ours) == set(theirs) - extra
    with safe_open(str(ours_dir.parent / "hf" / "model.safetensors"), "pt") as hf:
        for layer in range(2):
            k = hf.get_tensor(f"model.layers.{layer}.self_attn.k_proj.k_scale")
            v = hf.get_tensor(f"model.layers.{layer}.self_attn.v_proj.v_scale")
            got = ours[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"]
            assert torch.equal(got, torch.maximum(k, v).reshape(1).float())


def test_int4_awq_matches_modelopts_writer_where_both_keep_the_tensors(modelopt_exports):
    theirs_dir, ours_dir = modelopt_exports("INT4_AWQ_CFG")
    config_o, (ours,) = read_checkpoint(ours_dir)
    config_m, (theirs,) = read_checkpoint(theirs_dir)
    assert config_o["quantization"] == config_m["quantization"]
    assert set(ours) == set(theirs)
    _compare(ours, theirs, kept_by_both(theirs), int4=True)


def test_our_decoder_reads_modelopts_checkpoint(modelopt_exports):
    theirs_dir, ours_dir = modelopt_exports("INT8_SMOOTHQUANT_CFG")
    theirs, ours = decode_checkpoint(theirs_dir), decode_checkpoint(ours_dir)
    assert theirs.keys() == ours.keys()
    _, (raw,) = read_checkpoint(theirs_dir)
    modules = {
        "self_attn.o_proj": "attention.dense",
        "mlp.gate_proj": "mlp.fc",
        "mlp.up_proj": "mlp.gate",
        "mlp.down_proj": "mlp.proj",
    }
    for layer in range(2):
        for hf, trt in modules.items():
            prefix = f"transformer.layers.{layer}.{trt}"
            step = (
                raw[f"{prefix}.weights_scaling_factor"][:, None]
                * raw[f"{prefix}.prequant_scaling_factor"].float()[None, :]
            )  # one int8 code of each element
            diff = (
                ours[f"model.layers.{layer}.{hf}.weight"]
                - theirs[f"model.layers.{layer}.{hf}.weight"]
            ).abs()
            assert bool((diff <= step * 1.001).all()), hf
    norms = [k for k in theirs if "norm" in k or "embed" in k]
    assert all(torch.equal(ours[k], theirs[k]) for k in norms)


@pytest.mark.parametrize(
    "preset", ["FP8_DEFAULT_CFG", "FP8_DEFAULT_CFG+KV", "INT8_SMOOTHQUANT_CFG", "INT4_AWQ_CFG"]
)
def test_modelopts_writer_and_ours_both_satisfy_the_conformance_rules(preset, modelopt_exports):
    from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint

    theirs_dir, ours_dir = modelopt_exports(preset)
    assert check_checkpoint(ours_dir) == []
    # NVIDIA's own writer of the format: the rules were read from TensorRT-LLM, not from it.
    assert check_checkpoint(theirs_dir) == []
