"""The quantisation report read back from saved checkpoints: numbers that make sense."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.quant.calibration import load_texts
from kiln.quant.layer_report import quantization_report
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from tests.quant.conftest import CALIBRATION, HELD_OUT, Quantised


@pytest.fixture(scope="module")
def report(tiny_llama: Path, quantised: Quantised) -> Any:
    texts = load_texts(HELD_OUT)
    made: dict[str, dict[str, Any]] = {}

    def get(key: str) -> dict[str, Any]:
        if key not in made:
            made[key] = quantization_report(tiny_llama, quantised(key)[0], texts, max_seq_len=96)
        return made[key]

    return get


def test_fp8_diverges_little_and_w4_more(report: Any) -> None:
    fp8, w4 = report("llmcompressor-fp8-kv_fp8"), report("llmcompressor-gptq-w4-g64-kv_int8")
    assert fp8["kl_mean"] < 0.03
    assert w4["kl_mean"] > 2 * fp8["kl_mean"]
    assert fp8["kl_p99"] >= fp8["kl_mean"]
    assert fp8["top1_agreement"] > w4["top1_agreement"]
    assert fp8["perplexity_float"] == w4["perplexity_float"]
    assert fp8["tokens"] == w4["tokens"] > 300


def test_weight_error_is_per_quantised_linear(report: Any) -> None:
    fp8, w4 = report("llmcompressor-fp8-kv_fp8"), report("llmcompressor-gptq-w4-g64-kv_int8")
    assert len(w4["layers"]) == 14  # 2 layers × 7 linears; lm_head is ignored
    assert all(layer["rel_mse"] < 2e-3 for layer in fp8["layers"])
    assert all(3e-3 < layer["rel_mse"] < 5e-2 for layer in w4["layers"])
    assert w4["worst_layer"] in {layer["name"] for layer in w4["layers"]}


@pytest.mark.parametrize(
    "key", ["llmcompressor-awq-w4-g64-asym", "modelopt-awq-w4-g64", "modelopt-w4a8-awq-g64"]
)
def test_smoothing_is_undone_before_comparing_weights(report: Any, key: str) -> None:
    """AWQ folds scales into norms and neighbours; uncorrected, those would dominate the error."""
    layers = report(key)["layers"]
    assert any(layer["smoothing_corrected"] for layer in layers)
    assert all(layer["rel_mse"] < 5e-2 for layer in layers)


@pytest.mark.parametrize("key", ["modelopt-fp8-kv_fp8", "modelopt-smoothquant-static"])
def test_modelopt_exports_are_read_back(report: Any, key: str) -> None:
    result = report(key)
    assert result["format"] == "modelopt"
    assert len(result["layers"]) == 14
    assert result["kl_mean"] < 0.03
    assert all(layer["rel_mse"] < 2e-3 for layer in result["layers"])


def test_float_copy_agrees_exactly(tiny_llama: Path, tmp_path: Path) -> None:
    quantize(tiny_llama, resolve(QuantSpec()), CALIBRATION, tmp_path)
    result = quantization_report(tiny_llama, tmp_path, load_texts(HELD_OUT), max_seq_len=32)
    assert result["format"] == "float" and result["layers"] == []
    assert result["kl_mean"] == pytest.approx(0, abs=1e-6)
    assert result["top1_agreement"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fp8_codes_through_the_table_are_torchs_conversion(dtype: str) -> None:
    """Every e4m3 code (NaNs and signed zeros included) decodes through kiln's table to the
    bits torch's conversion gives, and the report's fake quantisation is unchanged by it."""
    import torch

    from kiln.quant.streamed_model import fake_quant_fp8
    from kiln.runtime.formats.weights import fp8_as

    want = getattr(torch, dtype)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    bits = torch.int32 if want == torch.float32 else torch.int16
    assert torch.equal(fp8_as(codes, want).view(bits), codes.to(want).view(bits))
    torch.manual_seed(0)
    x, scale = (torch.randn(64, 96) * 5).to(want), torch.tensor(0.02, dtype=want)
    expected = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(want) * scale
    assert torch.equal(fake_quant_fp8(x, scale), expected)


@pytest.mark.parametrize("group", [None, 64])
def test_a_weight_decoded_by_blocks_of_rows_is_the_weight_decoded_whole(
    group: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report decodes each quantised weight a cache-sized block of rows at a time: the
    same values as decoding it whole, and the blocks it hands on make up its effective weight
    (× the pre-quant scale)."""
    import torch

    from kiln.quant import streamed_model
    from kiln.runtime.formats.weights import LinearWeights, WeightScheme, dequantize

    torch.manual_seed(0)
    rows, cols = 301, 256
    if group is None:  # FP8 per channel
        scheme = WeightScheme(type="float", num_bits=8, strategy="channel")
        codes = (torch.randn(rows, cols) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(rows, 1) + 0.01
    else:  # int4 codes in groups of 64, with zero points
        scheme = WeightScheme(type="int", num_bits=4, strategy="group", group_size=group)
        codes = torch.randint(-8, 8, (rows, cols), dtype=torch.int8)
        scale = torch.rand(rows, cols // group) + 0.01
    zero = None if group is None else torch.randint(-2, 2, scale.shape, dtype=torch.int8)
    pqs = torch.rand(cols) + 0.5
    linear = LinearWeights(scheme, codes, scale=scale, zero_point=zero, pre_quant_scale=pqs)
    blocks: list[tuple[int, torch.Tensor]] = []
    whole = dequantize(linear, torch.float32)
    monkeypatch.setattr(streamed_model, "ROW_BLOCK_BYTES", 4 * cols * 7)  # 43 blocks of 7 rows
    got = streamed_model.decoded(linear, torch.bfloat16, "q", lambda n, s, b: blocks.append((s, b)))
    assert torch.equal(got, whole.to(torch.bfloat16))
    blocks.sort(key=lambda block: block[0])  # heard from the decoding threads in any order
    assert [s for s, _ in blocks] == list(range(0, rows, 7))
    assert torch.equal(torch.cat([b for _, b in blocks]), whole * pqs[None, :])


def test_weights_compared_by_blocks_on_threads_match_the_layer_at_a_time_comparison(
    tiny_llama: Path, quantised: Quantised, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report compares each weight as the forward decodes it, blocks of rows on several
    threads in any order: the same errors as comparing each weight whole, the same figures run
    after run."""
    from kiln.quant import streamed_model
    from kiln.quant.layer_report import layer_weight_errors

    checkpoint = quantised("llmcompressor-gptq-w4-g64-kv_int8")[0]
    monkeypatch.setattr(streamed_model, "ROW_BLOCK_BYTES", 4 * 64 * 3)  # blocks of a few rows
    texts = load_texts(HELD_OUT)[:2]
    first = quantization_report(tiny_llama, checkpoint, texts, max_seq_len=32, smoothing=False)
    again = quantization_report(tiny_llama, checkpoint, texts, max_seq_len=32, smoothing=False)
    assert first["layers"] == again["layers"]
    names = [layer["name"] for layer in first["layers"]]
    whole = layer_weight_errors(tiny_llama, checkpoint, names, smoothing=False)
    assert [layer["rel_mse"] for layer in first["layers"]] == pytest.approx(
        [layer["rel_mse"] for layer in whole], rel=1e-5
    )


def test_a_reference_made_in_its_own_process_gives_the_same_report(
    tiny_llama: Path, quantised: Quantised, tmp_path: Path
) -> None:
    """The float half computed beforehand by `python -m kiln.quant.reference` (as `kiln
    compile` runs it beside the quantisation) gives the report computed in one go."""
    import json
    import os
    import subprocess
    import sys

    from kiln.quant.layer_report import report_samples
    from kiln.quant.reference import SAMPLES_FILE

    texts = load_texts(HELD_OUT)
    checkpoint = quantised("llmcompressor-fp8-kv_fp8")[0]
    (tmp_path / SAMPLES_FILE).write_text(json.dumps(report_samples(tiny_llama, texts, 96)))
    job = json.dumps({"float_dir": str(tiny_llama), "out_dir": str(tmp_path)}) + "\n"
    subprocess.run([sys.executable, "-m", "kiln.quant.reference", str(os.getpid())],
                   input=job.encode(), check=True, timeout=300)  # fmt: skip
    heard: list[str] = []
    alone = quantization_report(tiny_llama, checkpoint, texts, max_seq_len=96)
    beside = quantization_report(tiny_llama, checkpoint, texts, max_seq_len=96,
                                 progress=heard.append, reference=tmp_path)  # fmt: skip
    assert beside["layers"] == alone["layers"]  # the weights: the quantised side's alone
    figures = {k: v for k, v in alone.items() if isinstance(v, float)}
    assert {k: beside[k] for k in figures} == pytest.approx(figures, rel=1e-6)
    assert not any(m.startswith("float model batches") for m in heard)  # only the quantised ran


def test_a_reference_of_other_text_is_not_used(
    tiny_llama: Path, quantised: Quantised, tmp_path: Path
) -> None:
    """Log-probabilities made for other samples are refused by name, and the report computes
    its own: the same figures as without them."""
    from kiln.quant.layer_report import float_reference, report_dtype, report_samples
    from kiln.quant.streamed_model import float_model

    texts = load_texts(HELD_OUT)
    checkpoint = quantised("llmcompressor-fp8-kv_fp8")[0]
    other = report_samples(tiny_llama, texts[1:], 96)
    float_reference(float_model(tiny_llama, "cpu", report_dtype(tiny_llama)), other, tmp_path)
    heard: list[str] = []
    got = quantization_report(tiny_llama, checkpoint, texts, max_seq_len=96,
                              progress=heard.append, reference=tmp_path)  # fmt: skip
    assert got == quantization_report(tiny_llama, checkpoint, texts, max_seq_len=96)
    assert any("computed on other samples" in m and "computing them now" in m for m in heard)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fp8_codes_decoded_two_at_a_time_are_torchs_conversion(dtype: str) -> None:
    """Every pair of codes, in either order, through the table of pairs; an odd count's last
    code and a tensor starting at an odd byte too."""
    import torch

    from kiln.runtime.formats.weights import fp8_as

    want = getattr(torch, dtype)
    bits = torch.int32 if want == torch.float32 else torch.int16
    every = torch.arange(1 << 16, dtype=torch.int32)
    pairs = torch.stack([every & 0xFF, every >> 8], dim=1).to(torch.uint8).reshape(-1)
    for codes in (pairs, pairs[:257], pairs[1:], pairs[1:258]):  # even, odd, odd offsets
        fp8 = codes.view(torch.float8_e4m3fn)
        assert torch.equal(fp8_as(fp8, want).view(bits), fp8.to(want).view(bits))


def test_a_large_tensor_of_fp8_codes_is_decoded_in_pieces_alike() -> None:
    """fp8_as splits a tensor of more codes than one piece over the cores; every piece decodes
    as torch converts it, in the tensor's shape."""
    import torch

    from kiln.runtime.formats import weights

    codes = torch.randint(0, 256, (3, weights._TABLE_PIECE + 12345), dtype=torch.uint8)
    codes = codes.view(torch.float8_e4m3fn)
    for want, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        got = weights.fp8_as(codes, want)
        assert got.shape == codes.shape
        assert torch.equal(got.view(bits), codes.to(want).view(bits))


def test_no_weights_left_to_compare_says_nothing(tmp_path: Path) -> None:
    """Where the report's forward compared every weight, no "(0/0)" count is shown."""
    from kiln.quant.layer_report import layer_weight_errors

    heard: list[str] = []
    assert layer_weight_errors(tmp_path, tmp_path, [], progress=heard.append) == []
    assert heard == []
