"""Importing pre-quantised AutoAWQ / AutoGPTQ / GPTQModel checkpoints without recalibration.

The checkpoints are real files in each library's layout, written from the tiny Llama by
tests/prequantized.py; the converted checkpoints are read back by compressed-tensors,
transformers and kiln's TensorRT-LLM reader, never by the converter itself.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import unpack_from_int32
from safetensors.torch import load_file, save_file

from kiln.compiler import sources
from kiln.quant.prequantized import convert as prequantized
from kiln.quant.prequantized.detect import (
    SUPPORTED,
    PreQuantized,
    check_recipe,
    detect,
    read_config,
)
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import SourceError
from tests.prequantized import (
    PreQuantizedCheckpoint,
    make_awq_checkpoint,
    make_gptq_checkpoint,
    reference_model,
)

# name → builder arguments; every variant the converter handles
VARIANTS: dict[str, dict[str, Any]] = {
    "awq-g64": {"kind": "awq"},
    "awq-per-channel": {"kind": "awq", "group_size": None},
    "autogptq-sym-g64": {"kind": "gptq"},
    "autogptq-asym-g32": {"kind": "gptq", "sym": False, "group_size": 32},
    "gptqmodel-v2-asym-sharded": {
        "kind": "gptq",
        "sym": False,
        "checkpoint_format": "gptq_v2",
        "producer": "gptqmodel",
        "shards": 2,
    },
    "autogptq-w8-per-channel": {"kind": "gptq", "bits": 8, "group_size": None},
}


@pytest.fixture(scope="module")
def checkpoints(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """get(variant) → (source checkpoint, converted dir, convert() record), built once."""
    made: dict[str, tuple[PreQuantizedCheckpoint, Path, dict[str, Any]]] = {}

    def get(name: str) -> tuple[PreQuantizedCheckpoint, Path, dict[str, Any]]:
        if name not in made:
            args = dict(VARIANTS[name])
            kind = args.pop("kind")
            out = tmp_path_factory.mktemp(name)
            build = make_awq_checkpoint if kind == "awq" else make_gptq_checkpoint
            source = build(tiny_llama, out / "source", **args)
            made[name] = (source, out / "ct", prequantized.convert(source.path, out / "ct"))
        return made[name]

    return get


def copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of checkpoint `src` whose quantization_config has `changes` applied."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def dequantised(ct_dir: Path) -> dict[str, torch.Tensor]:
    """(code − zero) × scale of every packed linear, decoded with compressed-tensors."""
    config = json.loads((ct_dir / "config.json").read_text())["quantization_config"]
    bits = config["config_groups"]["group_0"]["weights"]["num_bits"]
    tensors: dict[str, torch.Tensor] = {}
    for path in ct_dir.glob("*.safetensors"):
        tensors |= load_file(str(path))
    out = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            name = key.removesuffix(".weight_packed")
            shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
            codes = unpack_from_int32(tensors[key], bits, shape).long()
            scale = tensors[f"{name}.weight_scale"]
            zero = torch.zeros(scale.shape, dtype=torch.long)
            if f"{name}.weight_zero_point" in tensors:
                packed = tensors[f"{name}.weight_zero_point"]
                zero = unpack_from_int32(packed, bits, scale.shape, packed_dim=0).long()
            group = shape[1] // scale.shape[1]
            offset = codes - zero.repeat_interleave(group, 1)
            out[name] = offset.float() * scale.float().repeat_interleave(group, 1)
    return out


# --- detect -------------------------------------------------------------------------------------


def test_autoawq_gemm_config_is_detected(checkpoints: Any) -> None:
    source, _, _ = checkpoints("awq-g64")
    pre = detect(read_config(source.path))
    assert pre == PreQuantized(
        method="awq", bits=4, group_size=64, symmetric=False, format="gemm", producer="autoawq"
    )
    assert pre.to_spec() == QuantSpec(method="awq", weight_bits=4, group_size=64, symmetric=False)


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("autogptq-sym-g64", ("gptq", 4, 64, True, "gptq", "autogptq")),
        ("gptqmodel-v2-asym-sharded", ("gptq", 4, 64, False, "gptq_v2", "gptqmodel")),
        ("autogptq-w8-per-channel", ("gptq", 8, None, True, "gptq", "autogptq")),
    ],
)
def test_autogptq_and_gptqmodel_configs_are_detected(
    checkpoints: Any, variant: str, expected: tuple[Any, ...]
) -> None:
    pre = detect(read_config(checkpoints(variant)[0].path))
    assert pre is not None
    assert (pre.method, pre.bits, pre.group_size, pre.symmetric, pre.format, pre.producer) == (
        expected
    )


def test_gptqmodel_gemm_export_labelled_gptq_is_an_awq_checkpoint() -> None:
    # GPTQModel 7.6's RTN export to AutoAWQ GEMM writes quant_method gptq with format gemm
    config = {"quantization_config": {"quant_method": "gptq", "format": "gemm", "bits": 4,
                                      "group_size": 64, "sym": False,
                                      "meta": {"quantizer": ["gptqmodel:7.6.0"]}}}  # fmt: skip
    pre = detect(config)
    assert pre is not None and (pre.method, pre.format, pre.producer) == (
        "awq",
        "gemm",
        "gptqmodel",
    )


def test_autogptq_quantize_config_json_alone_is_read(checkpoints: Any, tmp_path: Path) -> None:
    model = copy_with_config(checkpoints("autogptq-sym-g64")[0].path, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    quantize_config = config.pop("quantization_config")
    quantize_config.pop("quant_method")  # early AutoGPTQ wrote neither key
    (model / "config.json").write_text(json.dumps(config))
    (model / "quantize_config.json").write_text(json.dumps(quantize_config))
    pre = detect(read_config(model))
    assert pre is not None and (pre.method, pre.group_size, pre.symmetric) == ("gptq", 64, True)


@pytest.mark.parametrize(
    "quantization_config",
    [None, {}, {"quant_method": "compressed-tensors"}, {"quant_method": "fp8"},
     {"quant_method": "bitsandbytes", "load_in_4bit": True}],
)  # fmt: skip
def test_float_and_other_quantised_configs_are_not_imports(quantization_config: Any) -> None:
    assert detect({"quantization_config": quantization_config}) is None


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "version": "GEMV_FAST"}, "version='gemv_fast'"),
        ({**AWQ, "version": "marlin"}, "version='marlin'"),
        ({**AWQ, "version": "exllama"}, "version='exllama'"),
        ({**AWQ, "zero_point": False}, "zero_point=False"),
        ({**AWQ, "backend": "llm-awq"}, "backend='llm-awq'"),
        ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({**GPTQ, "format": "bitblas"}, "checkpoint_format='bitblas'"),
        ({**GPTQ, "is_marlin_format": True}, "checkpoint_format='marlin'"),
        ({**GPTQ, "bits": 3}, "bits=3"),
        ({**GPTQ, "desc_act": True}, "desc_act=True"),
        ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype='int16'"),
        ({**GPTQ, "dynamic": {r"+:.*down_proj": {"bits": 8}}}, "dynamic="),
    ],
)
def test_variants_that_cannot_be_imported_exactly_are_refused(
    config: dict[str, Any], key: str
) -> None:
    with pytest.raises(SourceError) as refused:
        detect({"quantization_config": config})
    message = refused.value.message
    assert f"config.json quantization_config.{key}" in message
    assert f"kiln imports {SUPPORTED} checkpoints" in message


def test_desc_act_with_static_groups_is_imported() -> None:
    pre = detect({"quantization_config": {**GPTQ, "desc_act": True, "static_groups": True}})
    assert pre is not None and pre.desc_act


# --- convert ------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converted_weights_dequantise_to_the_checkpoints_values_exactly(
    checkpoints: Any, variant: str
) -> None:
    source, ct_dir, _ = checkpoints(variant)
    got = dequantised(ct_dir)
    assert sorted(got) == sorted(source.reference)
    for name, reference in source.reference.items():
        assert torch.equal(got[name], reference), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_float_parts_are_copied_unchanged(checkpoints: Any, variant: str) -> None:
    source, ct_dir, _ = checkpoints(variant)
    tensors: dict[str, torch.Tensor] = {}
    for path in ct_dir.glob("*.safetensors"):
        tensors |= load_file(str(path))
    for key, value in source.floats.items():
        assert tensors[key].dtype == torch.float16 and torch.equal(tensors[key], value), key


@pytest.mark.parametrize("variant", ["awq-g64", "autogptq-sym-g64", "gptqmodel-v2-asym-sharded"])
def test_transformers_logits_equal_the_reference_dequantised_model(
    checkpoints: Any, tiny_llama: Path, variant: str
) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    source, ct_dir, _ = checkpoints(variant)
    loaded = AutoModelForCausalLM.from_pretrained(
        ct_dir, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    reference = reference_model(tiny_llama, source)
    ids = torch.arange(1, 48)[None]
    with torch.no_grad():
        # Tolerance 1e-5 absolute on logits of order 1: both models hold the same float32
        # weights, so only summation order could differ (observed: identical).
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)


def test_qwen2_with_tied_embeddings_converts_exactly(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from tests.tiny_models import make_tiny_model

    tiny = make_tiny_model(tmp_path / "float", arch="qwen2", tie_word_embeddings=True)
    source = make_awq_checkpoint(tiny, tmp_path / "awq")
    record = prequantized.convert(source.path, tmp_path / "ct")
    assert record.ignore == ["lm_head"]  # no lm_head tensor, but transformers builds a Linear
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ct",
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    ).eval()
    ids = torch.arange(1, 48)[None]
    with torch.no_grad():
        expected = reference_model(tiny, source)(ids).logits
        torch.testing.assert_close(loaded(ids).logits, expected, atol=1e-5, rtol=0)


def test_config_and_tensors_are_laid_out_as_llm_compressor_writes_them(
    checkpoints: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64, symmetric=False)
    calibration = CalibrationSpec(dataset="builtin:licenses", num_samples=2, max_seq_len=32)
    quantize(tiny_llama, resolve(spec), calibration, tmp_path / "llmc")
    theirs = json.loads((tmp_path / "llmc" / "config.json").read_text())["quantization_config"]
    ours = json.loads((checkpoints("awq-g64")[1] / "config.json").read_text())[
        "quantization_config"
    ]
    assert ours.keys() == theirs.keys()
    assert {k: v for k, v in ours.items() if k != "config_groups"} == {
        k: v for k, v in theirs.items() if k != "config_groups"
    }
    our_group, their_group = ours["config_groups"]["group_0"], theirs["config_groups"]["group_0"]
    assert our_group.keys() == their_group.keys()
    # No observer ran and AWQ has no act-order: the only two fields that differ.
    differ = {"observer", "actorder"}
    assert {k: v for k, v in our_group["weights"].items() if k not in differ} == {
        k: v for k, v in their_group["weights"].items() if k not in differ
    }
    their_tensors = load_file(str(tmp_path / "llmc" / "model.safetensors"))
    our_tensors = load_file(str(checkpoints("awq-g64")[1] / "model.safetensors"))
    assert our_tensors.keys() == their_tensors.keys()
    for key, theirs_t in their_tensors.items():
        assert our_tensors[key].shape == theirs_t.shape, key
        if theirs_t.dtype in (torch.int32, torch.int64):
            assert our_tensors[key].dtype == theirs_t.dtype, key


def test_record_reads_like_a_quantize_record(checkpoints: Any) -> None:
    _, _, record = checkpoints("awq-g64")
    assert {k: record.to_dict()[k] for k in ("scheme", "backend", "format", "source_format")} == {
        "scheme": "W4A16_AWQ",
        "backend": "import",
        "format": "compressed-tensors",
        "source_format": "autoawq-gemm",
    }
    assert record.trtllm_quant_algo == "W4A16_AWQ" and record.calibration is None
    assert (record.group_size, record.symmetric, record.ignore) == (64, False, ["lm_head"])
    assert checkpoints("autogptq-w8-per-channel")[2].trtllm_quant_algo == "W8A16"


def test_tokenizer_and_generation_config_come_along(checkpoints: Any) -> None:
    source, ct_dir, _ = checkpoints("autogptq-sym-g64")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ct_dir / name).read_bytes() == (source.path / name).read_bytes()


def test_sharded_source_gives_a_sharded_checkpoint_with_an_index(checkpoints: Any) -> None:
    _, ct_dir, _ = checkpoints("gptqmodel-v2-asym-sharded")
    index = json.loads((ct_dir / "model.safetensors.index.json").read_text())
    files = {path.name for path in ct_dir.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files and len(files) == 2
    for name in files:
        assert all(index["weight_map"][key] == name for key in load_file(str(ct_dir / name)))


def test_tensorrt_llm_reader_sees_the_same_values(checkpoints: Any) -> None:
    from kiln.compiler.trtllm.export.source import read_source
    from kiln.runtime.formats.weights import effective_weight

    source, ct_dir, record = checkpoints("awq-g64")
    read = read_source(ct_dir, record.trtllm_quant_algo)
    for name, reference in source.reference.items():
        assert torch.equal(effective_weight(read.linears[name], torch.float32), reference), name


@pytest.mark.parametrize("variant", ["awq-g64", "gptqmodel-v2-asym-sharded"])
def test_tensorrt_llm_checkpoint_exports_from_the_import(
    checkpoints: Any, tmp_path: Path, variant: str
) -> None:
    from kiln.compiler.trtllm.export.writer import export_checkpoint

    _, ct_dir, record = checkpoints(variant)
    exported = export_checkpoint(ct_dir, tmp_path / "trt", quant_algo=record.trtllm_quant_algo)
    config = json.loads((tmp_path / "trt" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"  # GPTQ shares AWQ's kernel
    assert (tmp_path / "trt" / "rank0.safetensors").is_file() and exported


@pytest.mark.parametrize("variant", ["awq-g64", "autogptq-sym-g64"])
def test_kiln_runtime_reads_the_same_values(checkpoints: Any, variant: str) -> None:
    from kiln.runtime.engine.loader import load_model
    from kiln.runtime.formats.checkpoint import open_checkpoint
    from kiln.runtime.formats.weights import dequantize

    source, ct_dir, _ = checkpoints(variant)
    checkpoint = open_checkpoint(ct_dir)
    for name, reference in source.reference.items():
        assert torch.equal(dequantize(checkpoint.linear(name), torch.float32), reference), name
    load_model(ct_dir, "float32", torch.device("cpu"), 64)  # and builds its serving model


def test_permuted_g_idx_is_refused_even_when_the_config_hides_it(
    checkpoints: Any, tmp_path: Path
) -> None:
    model = copy_with_config(checkpoints("autogptq-sym-g64")[0].path, tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()  # act-order: groups out of column order
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SourceError, match="down_proj: g_idx permutes input columns"):
        prequantized.convert(model, tmp_path / "out")


def test_v1_zero_point_overflow_is_refused(checkpoints: Any, tmp_path: Path) -> None:
    model = copy_with_config(checkpoints("autogptq-asym-g32")[0].path, tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.qzeros"
    tensors[key] = tensors[key] | 0xF  # stored 15: a zero of 16 (AutoGPTQ's −1 overflow)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SourceError, match="k_proj: a gptq zero point of 16 does not fit 4 bits"):
        prequantized.convert(model, tmp_path / "out")


def test_sym_config_over_asymmetric_zero_points_is_refused(
    checkpoints: Any, tmp_path: Path
) -> None:
    model = copy_with_config(checkpoints("autogptq-asym-g32")[0].path, tmp_path / "m", sym=True)
    with pytest.raises(SourceError, match="says sym: true but the zero points are not all 8"):
        prequantized.convert(model, tmp_path / "out")


def test_config_that_disagrees_with_the_tensors_is_refused(
    checkpoints: Any, tmp_path: Path
) -> None:
    model = copy_with_config(checkpoints("autogptq-sym-g64")[0].path, tmp_path / "m", bits=8)
    with pytest.raises(SourceError, match="quantization_config disagrees with the tensors"):
        prequantized.convert(model, tmp_path / "out")


def test_bin_only_checkpoint_is_refused_with_the_fix(checkpoints: Any, tmp_path: Path) -> None:
    model = copy_with_config(checkpoints("awq-g64")[0].path, tmp_path / "m")
    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(tensors, model / "pytorch_model.bin")
    with pytest.raises(SourceError, match="from safetensors only"):
        prequantized.convert(model, tmp_path / "out")


# --- check_recipe -------------------------------------------------------------------------------

PRE = PreQuantized(method="awq", bits=4, group_size=128, symmetric=False, format="gemm",
                   producer="autoawq")  # fmt: skip


def test_an_omitted_quantization_section_fits_any_import() -> None:
    assert check_recipe(QuantSpec(), PRE) == []


def test_a_section_that_describes_the_checkpoint_fits() -> None:
    spec = QuantSpec(method="awq", weight_bits=4, group_size=128, symmetric=False)
    assert check_recipe(spec, PRE) == []


def test_a_section_asking_for_something_else_names_each_key() -> None:
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64, kv_cache="fp8")
    problems = check_recipe(spec, PRE)
    keys = [p.key for p in problems]
    assert keys == [
        "quantization.method",
        "quantization.group_size",
        "quantization.symmetric",
        "quantization.kv_cache",
    ]
    assert "the source is a 4-bit AWQ checkpoint (autoawq)" in problems[0].problem
    assert problems[0].allowed == "awq or omit the quantization section"


# --- as a model source --------------------------------------------------------------------------


def test_awq_and_gptq_directories_are_accepted_sources(checkpoints: Any, tmp_path: Path) -> None:
    for variant in ("awq-g64", "autogptq-sym-g64"):
        path = checkpoints(variant)[0].path
        ref = sources.parse_source(str(path), base_dir=tmp_path)
        info = sources.inspect_source(ref)
        assert (info.architecture, info.hidden_size, info.torch_dtype) == (
            "LlamaForCausalLM",
            128,
            "float16",
        )
        assert sources.check_architecture(info) == []
        assert sources.materialize(ref, tmp_path / "cache") == path


def test_hub_cache_snapshot_of_an_awq_checkpoint_is_accepted(
    checkpoints: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub's layout: blobs/<sha256>, snapshots/<rev>/<file> → blob, refs/main
    repo, revision = tmp_path / "hub" / "models--org--tiny-awq", "b" * 40
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for src in sorted(checkpoints("awq-g64")[0].path.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snapshot / src.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ref = sources.parse_source("hf:org/tiny-awq", base_dir=tmp_path)
    assert sources.check_architecture(sources.inspect_source(ref)) == []
    assert sources.materialize(ref, tmp_path / "cache") == snapshot
    prequantized.convert(ref.path, tmp_path / "ct")
    assert dequantised(tmp_path / "ct").keys() == checkpoints("awq-g64")[0].reference.keys()


def test_refused_import_variant_is_a_source_problem(checkpoints: Any, tmp_path: Path) -> None:
    model = copy_with_config(checkpoints("awq-g64")[0].path, tmp_path / "m", version="gemv")
    info = sources.inspect_source(sources.parse_source(str(model), base_dir=tmp_path))
    (problem,) = sources.check_architecture(info)
    assert problem.startswith("config.json quantization_config.version='gemv': the AWQ gemv")


def test_other_quantised_checkpoints_are_refused_naming_what_is_imported(
    checkpoints: Any,
) -> None:
    ct_dir = checkpoints("awq-g64")[1]  # compressed-tensors: kiln's own output format
    info = sources.inspect_source(sources.parse_source(str(ct_dir), base_dir=ct_dir))
    assert sources.check_architecture(info) == [
        "the checkpoint is already quantised (quantization_config.quant_method="
        f"compressed-tensors); kiln imports only {SUPPORTED} checkpoints — point "
        "model.source at one of those or at the float checkpoint it was made from"
    ]


def test_quantize_config_json_is_part_of_the_source_digest(
    checkpoints: Any, tmp_path: Path
) -> None:
    model = copy_with_config(checkpoints("autogptq-sym-g64")[0].path, tmp_path / "m")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    (model / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 64}))
    before = sources.source_digest(ref)
    (model / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    assert sources.source_digest(ref) != before
