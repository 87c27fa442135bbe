"""What kiln writes for TensorRT-LLM 1.2 obeys the rules its loaders apply
(compiler/trtllm/rules/checkpoint.py), and the export defects those rules exposed stay fixed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.compiler.trtllm.deploy import target_failures
from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.linears import fuse_linears
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint, check_config
from kiln.compiler.trtllm.rules.exclusions import build_quantises, module_excluded, padded_features
from kiln.compiler.trtllm.rules.pytorch import pytorch_problem
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.formats.artifact import TargetRecord
from kiln.runtime.formats.weights import LinearWeights, WeightScheme
from tests.compiler.test_compile import kiln, published, recipe_file
from tests.compiler.test_trtllm_export import SPECS
from tests.compiler.trtllm_recipes import quantised_per_mode

CALIBRATION = CalibrationSpec(num_samples=4, max_seq_len=32)
W8A16 = QuantSpec(method="gptq", weight_bits=8)
DOWN_0 = r"re:model\.layers\.0\.mlp\.down_proj$"


def _quantised(model: Path, spec: QuantSpec, out: Path) -> Path:
    quantize(model, resolve(spec), CALIBRATION, out)
    return out


def test_int8_codes_requantised_to_a_shared_scale_round_to_nearest():
    int8 = WeightScheme(type="int", num_bits=8, strategy="tensor")
    q = LinearWeights(int8, torch.tensor([[3, -5]], dtype=torch.int8), torch.tensor([[0.9]]))
    k = LinearWeights(int8, torch.tensor([[7, 1]], dtype=torch.int8), torch.tensor([[1.0]]))
    fused = fuse_linears([q, k], "W8A8", [], "qkv")
    # 3 × 0.9 = 2.7 → 3 (truncation gave 2); -5 × 0.9 = -4.5 → -4 (ties to even)
    assert fused.weight.tolist() == [[3, -4], [7, 1]]
    assert fused.scale is not None and torch.all(fused.scale == 1.0)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_requantised_a_block_of_rows_at_a_time_as_whole(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused codes and the change noted are those of re-expressing each weight whole."""
    from kiln.compiler.trtllm.export import linears
    from kiln.runtime.formats.weights import as_float32, dequantize

    torch.manual_seed(7)
    fp8 = kind == "fp8"
    scheme = WeightScheme(type="float" if fp8 else "int", num_bits=8, strategy="tensor")

    def part(rows: int, scale: float) -> LinearWeights:
        values = torch.randn(rows, 48) * (60 if fp8 else 40)
        if fp8:
            codes = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            codes = values.round().clamp(-128, 127).to(torch.int8)
        return LinearWeights(scheme, codes, torch.full((rows, 1), scale))

    parts = [part(37, 0.9), part(5, 1.7), part(11, 0.25)]
    scale = torch.tensor(1.7)
    monkeypatch.setattr(linears, "ROW_BLOCK_BYTES", 4 * 48 * 4)  # blocks of 4 rows
    bits = torch.uint8 if fp8 else torch.int8
    for p in parts[::2]:
        assert p.scale is not None
        codes, change = linears.at_scale(p, scale)
        whole = linears.requantize(p.weight, p.scale / scale)  # the weight at once
        before, after = dequantize(p, torch.float32), as_float32(whole) * scale
        expected = float((before - after).abs().max() / before.abs().max())
        assert codes.dtype == p.weight.dtype
        assert torch.equal(codes.view(bits), whole.view(bits))
        assert change == expected and change > 0
    notes: list[str] = []
    fused = fuse_linears(parts, "FP8" if fp8 else "W8A8", notes, "qkv")
    assert fused.weight.shape == (53, 48)
    assert fused.scale is not None and bool((fused.scale == scale).all())
    assert len(notes) == 1 and "re-quantised to one" in notes[0]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("ratio", [0.37, 1.9, 1.0 + 2**-20])
def test_requantised_through_the_code_table_as_through_blocks(
    kind: str, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-byte weight at one scale re-expressed through its 256 codes' table: the codes and
    the change figure of the block path, bit for bit, for every code (FP8's NaNs, the ends
    that saturate when the scale shrinks, an odd count)."""
    from kiln.compiler.trtllm.export import linears

    torch.manual_seed(11)
    fp8 = kind == "fp8"
    scheme = WeightScheme(type="float" if fp8 else "int", num_bits=8, strategy="tensor")
    dtype = torch.float8_e4m3fn if fp8 else torch.int8
    every = torch.arange(256, dtype=torch.uint8).repeat(9)
    bits = torch.cat([every, torch.randint(0, 256, (97 * 131 - len(every),), dtype=torch.uint8)])
    if fp8:  # NaN codes (0x7f, 0xff) only where the test asks for them
        bits = torch.where((bits & 0x7F) == 0x7F, bits - 1, bits)
    bits = bits[torch.randperm(len(bits))].view(97, 131)
    old = torch.tensor(0.013)
    for nan in [False, True] if fp8 else [False]:
        codes = bits.clone()
        if nan:
            codes[40, 7] = 0xFF
        p = LinearWeights(scheme, codes.view(dtype), old.expand(97, 1).contiguous())
        new = old / ratio
        monkeypatch.setattr(linears, "BY_CODE_MIN", 0)
        assert linears._by_code(p, new) is not None
        monkeypatch.setattr(linears, "BY_CODE_MIN", 1 << 62)
        blocks, block_change = linears.at_scale(p, new)
        monkeypatch.setattr(linears, "BY_CODE_MIN", 0)
        table, table_change = linears.at_scale(p, new)
        assert torch.equal(table.view(torch.uint8), blocks.view(torch.uint8))
        if nan:
            assert block_change != block_change and table_change != table_change
        else:
            assert table_change == block_change and table_change > 0


def test_requantised_through_blocks_where_rows_differ_in_scale():
    from kiln.compiler.trtllm.export import linears

    scheme = WeightScheme(type="float", num_bits=8, strategy="tensor")
    codes = torch.randn(300, 300).to(torch.float8_e4m3fn)
    scales = torch.full((300, 1), 0.5)
    assert linears._by_code(LinearWeights(scheme, codes, scales), torch.tensor(1.0)) is not None
    scales[299] = 0.25
    assert linears._by_code(LinearWeights(scheme, codes, scales), torch.tensor(1.0)) is None


def test_kiln_validate_refuses_group_32_for_tensorrt_llm_int4(tmp_path: Path, tiny_llama: Path):
    recipe = recipe_file(tmp_path, tiny_llama, method="awq", extra="targets: [h100-sxm]\n")
    recipe.write_text(recipe.read_text().replace("group_size: 64", "group_size: 32"))
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "quantization.group_size 32" in stderr and "64 or 128" in stderr


def test_weight_only_exports_keep_trtllms_default_exclusions(tiny_llama: Path, tmp_path: Path):
    export_checkpoint(_quantised(tiny_llama, W8A16, tmp_path / "q"), tmp_path / "trt")
    config, _ = read_checkpoint(tmp_path / "trt")
    patterns = config["quantization"]["exclude_modules"]
    assert module_excluded("transformer.vocab_embedding", patterns)
    assert module_excluded("lm_head", patterns)
    assert not module_excluded("transformer.layers.0.mlp.proj", patterns)
    assert check_checkpoint(tmp_path / "trt") == []


def test_an_fp8_export_with_a_quantised_lm_head_conforms(tiny_llama: Path, tmp_path: Path):
    """Since TensorRT-LLM PR #3567 an empty exclude_modules excludes nothing (defaults apply
    only when it is absent), so FP8 with lm_head quantised is a valid checkpoint."""
    spec = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", ignore=())
    export_checkpoint(_quantised(tiny_llama, spec, tmp_path / "q"), tmp_path / "trt")
    config, (rank,) = read_checkpoint(tmp_path / "trt")
    assert config["quantization"]["exclude_modules"] == []
    assert not module_excluded("lm_head", [])
    assert module_excluded("lm_head", None)  # absent: TensorRT-LLM's defaults
    assert rank["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert check_checkpoint(tmp_path / "trt") == []


def test_a_float_linear_is_excluded_for_every_trtllm_matcher(tiny_llama: Path, tmp_path: Path):
    spec = QuantSpec(method="gptq", weight_bits=8, ignore=("lm_head", DOWN_0))
    export_checkpoint(_quantised(tiny_llama, spec, tmp_path / "q"), tmp_path / "trt")
    config, _ = read_checkpoint(tmp_path / "trt")
    patterns = config["quantization"]["exclude_modules"]
    assert module_excluded("transformer.layers.0.mlp.proj", patterns)
    assert not build_quantises("transformer.layers.0.mlp.proj.weight", patterns)
    assert build_quantises("transformer.layers.1.mlp.proj.weight", patterns)
    assert check_checkpoint(tmp_path / "trt") == []


def test_bare_module_names_leave_the_embedding_and_float_weights_to_be_quantised():
    config = json.loads(json.dumps(_CONFIG))
    config["quantization"] = {
        "quant_algo": "W8A16",
        "exclude_modules": ["lm_head", "transformer.layers.0.mlp.proj"],
    }
    problems = check_config(config)
    assert any("transformer.vocab_embedding" in p for p in problems)
    assert any(
        p.startswith("transformer.layers.0.mlp.proj: trtllm-build would quantise") for p in problems
    )


def test_a_groupwise_float_linear_keeps_its_float_tensors(tiny_llama: Path, tmp_path: Path):
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64, ignore=("lm_head", DOWN_0))
    export_checkpoint(_quantised(tiny_llama, spec, tmp_path / "q"), tmp_path / "trt")
    assert check_checkpoint(tmp_path / "trt") == []
    with safe_open(str(tmp_path / "trt" / "rank0.safetensors"), "pt") as f:
        assert f.get_tensor("transformer.layers.0.mlp.proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("transformer.layers.1.mlp.proj.weight").dtype == torch.int8


def test_smoothquant_plugin_refuses_a_float_decoder_linear(tiny_llama: Path, tmp_path: Path):
    spec = QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_dynamic", ignore=("lm_head", DOWN_0)
    )
    from kiln.runtime.base.errors import UsageError

    with pytest.raises(UsageError) as err:
        export_checkpoint(_quantised(tiny_llama, spec, tmp_path / "q"), tmp_path / "trt")
    assert "transformer.layers.0.mlp.proj" in err.value.message


def test_the_pytorch_backend_loads_modelopt_exports_not_weight_only_compressed_tensors():
    assert pytorch_problem("modelopt", "W4A16_AWQ") is None
    assert pytorch_problem("modelopt", "FP8") is None
    assert pytorch_problem("float", "NO_QUANT") is None
    assert pytorch_problem("compressed-tensors", "FP8_PER_CHANNEL_PER_TOKEN") is None
    for algo in ("W4A16_GPTQ", "W4A16_AWQ", "W8A16", "FP8"):
        why = pytorch_problem("compressed-tensors", algo)
        assert why is not None and "hf_quant_config.json" in why


@pytest.mark.parametrize(
    ("spec", "suggests_modelopt"),
    [
        (QuantSpec("smoothquant", 8, activations="int8_static", backend="modelopt"), False),
        (QuantSpec(method="gptq", weight_bits=4, backend="llmcompressor"), True),
    ],
    ids=["modelopt", "llmcompressor"],
)
def test_the_pytorch_fix_suggests_modelopt_only_to_a_recipe_not_using_it(
    spec: QuantSpec, suggests_modelopt: bool
) -> None:
    from kiln.quant.backends import BACKENDS

    why = pytorch_problem(BACKENDS[spec.backend].format, resolve(spec).trtllm_quant_algo)
    assert why is not None
    assert ("backend: modelopt" in why) is suggests_modelopt
    if not suggests_modelopt:  # another scheme, or the engine path
        assert "W4A16_AWQ" in why and "deploy.trtllm_path: engine" in why


def test_a_failed_build_or_no_usable_path_fails_the_target():
    def record(engine: str, pytorch: str) -> TargetRecord:
        return TargetRecord(engine=engine, pytorch=pytorch, plan="p", tp_size=1)

    assert target_failures("l40s", record("planned", "unsupported: x")) == []
    assert target_failures("l40s", record("skipped: path", "ready")) == []
    assert target_failures("l40s", record("failed: target build exited 1", "ready"))
    assert target_failures("l40s", record("unsupported: a", "unsupported: b")) == [
        "l40s: engine unsupported: a",
        "l40s: pytorch unsupported: b",
    ]
    assert target_failures("l40s", record("unsupported: a", "skipped: engine only"))


def test_kiln_validate_refuses_a_path_that_cannot_load_what_kiln_writes(
    tmp_path: Path, tiny_llama: Path
):
    # Asymmetric GPTQ int4 in compressed-tensors: the PyTorch backend cannot load it, and
    # its zero points have no place in the ModelOpt HF format kiln converts to.
    extra = "targets: [l40s]\ndeploy:\n  trtllm_path: pytorch\n"
    recipe = recipe_file(tmp_path, tiny_llama, extra=extra)
    recipe.write_text(
        recipe.read_text().replace("  method: gptq\n", "  method: gptq\n  symmetric: false\n")
    )
    code, _, stderr = kiln("validate", str(recipe))
    assert code == 2
    assert "does not load W4A16_GPTQ from a compressed-tensors checkpoint" in stderr
    assert "backend: modelopt" in stderr
    assert "nor does kiln convert it exactly: asymmetric int4 groups" in stderr


def test_compile_with_no_usable_target_path_exits_nonzero_and_publishes_nothing(
    tmp_path: Path, tiny_llama: Path
):
    # tp 4 cuts o_proj's 128 inputs into 32-column shards, inside groups of 64: no engine
    # checkpoint; and the PyTorch backend cannot load GPTQ int4 compressed-tensors.
    extra = "targets: [l40s]\ndeploy:\n  tp_size: 4\n"
    recipe = recipe_file(tmp_path, tiny_llama, samples=4, seq=32, extra=extra)
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 3
    assert "not published" in stderr and "group of 64" in stderr
    status = json.loads(stdout)["targets"]["l40s"]
    assert status["engine"].startswith("unsupported:") and "group of 64" in status["engine"]
    assert status["pytorch"].startswith("unsupported:")
    assert published(tmp_path / "out") == []


def test_compile_json_reports_each_targets_status(tmp_path: Path, tiny_llama: Path):
    recipe = recipe_file(tmp_path, tiny_llama, samples=4, seq=32, extra="targets: [l40s]\n")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    status = json.loads(stdout)["targets"]["l40s"]
    # GPTQ int4 (symmetric, group 64): served on the PyTorch path from its exact ModelOpt
    # HF conversion (test_trtllm_modelopt_hf.py).
    assert status == {"engine": "planned", "pytorch": "ready"}


# ---- group-wise padding ------------------------------------------------------------------

_CONFIG = {
    "architecture": "LlamaForCausalLM",
    "dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 576,
    "intermediate_size": 768,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_size": 64,
    "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
}


def test_groupwise_features_pad_to_a_multiple_of_max_64_group_times_tp():
    assert [padded_features(576, 64, tp) for tp in (1, 2, 4)] == [576, 640, 768]
    assert [padded_features(576, 128, tp) for tp in (1, 2, 4)] == [640, 768, 1024]
    assert padded_features(1536, 128, 4) == 1536


@pytest.fixture(scope="module")
def awq_576(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hidden-576 Llama (SmolLM2's width) with 8 heads of 64, AWQ int4 group 64."""
    from tests.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("h576")
    model = make_tiny_model(
        root / "model", hidden_size=576, num_layers=1, num_heads=8, num_kv_heads=4,
        intermediate_size=768, head_dim=64,
    )  # fmt: skip
    spec = QuantSpec(method="awq", weight_bits=4, group_size=64, symmetric=False)
    return _quantised(model, spec, root / "q")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_hidden_576_groupwise_checkpoint_has_trtllms_padded_shapes(awq_576, tp, tmp_path):
    export_checkpoint(awq_576, tmp_path / "trt", tp_size=tp)
    assert check_checkpoint(tmp_path / "trt") == []
    hidden = padded_features(576, 64, tp)
    _, ranks = read_checkpoint(tmp_path / "trt")
    for rank in ranks:
        qkv = rank["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == ((8 + 2 * 4) * 64 // tp // 2, hidden)
        assert rank["transformer.layers.0.mlp.proj.weight"].shape == (hidden // 2, 768 // tp)
        assert rank["transformer.layers.0.mlp.proj.zero"].shape == (768 // tp // 64, hidden)


@pytest.mark.parametrize("tp", [2, 4])
def test_padded_shards_decode_to_the_unpadded_weights(awq_576, tp, tmp_path):
    export_checkpoint(awq_576, tmp_path / "one", tp_size=1)
    export_checkpoint(awq_576, tmp_path / "many", tp_size=tp)
    whole, split = decode_checkpoint(tmp_path / "one"), decode_checkpoint(tmp_path / "many")
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)


# ---- every scheme kiln exports, for Llama, Qwen2 and Qwen3, at tp 1, 2 and 4 -------------

# tiny models: hidden 128, 4 heads of 32, 2 KV heads, MLP 256; o_proj's 128 inputs at tp 4
# are 32 per rank, which cuts a group of 64. Qwen3's heads are 64 wide: o_proj has 256 inputs.
REFUSED = {("awq", 4): "group of 64", ("gptq", 4): "group of 64"}
# The SmoothQuant plugin layers build no q/k norms (compiler/trtllm/rules/engine.py).
QWEN3_REFUSED = {("sq_int8_kv", tp): "without the per-head q/k norms" for tp in (1, 2, 4)}


@pytest.fixture(scope="module")
def quantised_arch(tmp_path_factory, tiny_llama, tiny_qwen2, tiny_qwen3):
    """(arch, mode) → the tiny model of `arch` quantised by kiln as `mode` (made once)."""
    models = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}
    return quantised_per_mode(tmp_path_factory, models, SPECS, CALIBRATION)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mode", list(SPECS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_exported_scheme_conforms(quantised_arch, arch, mode, tp, tmp_path):
    from kiln.runtime.base.errors import UsageError

    refused = REFUSED if arch != "qwen3" else QWEN3_REFUSED
    try:
        export_checkpoint(quantised_arch(arch, mode), tmp_path, tp_size=tp)
    except UsageError as exc:
        assert refused.get((mode, tp), "not refused") in exc.message.replace("\n", " ")
        return
    assert (mode, tp) not in refused
    assert check_checkpoint(tmp_path) == []


# ---- trtllm-serve options -------------------------------------------------------------------


@pytest.mark.parametrize(
    "speculation",
    [{}, {"draft_dir": "draft/model", "max_draft_len": 4}, {"ngram_size": 3, "max_draft_len": 4}],
)
def test_the_serve_options_kiln_writes_are_llm_api_arguments(speculation):
    from kiln.compiler.trtllm.capacity import DeploySpec, plan
    from kiln.compiler.trtllm.rules.serve_options import check_serve_options
    from kiln.compiler.trtllm.serve_config import serve_options
    from kiln.compiler.trtllm.targets import get_profile
    from tests.compiler.test_trtllm_build import FP8_KV, LLAMA_32_1B

    deploy = DeploySpec(max_seq_len=8192, max_batch_size=64)
    p = plan(LLAMA_32_1B, resolve(FP8_KV), get_profile("h100-sxm"), deploy)
    assert check_serve_options(serve_options(resolve(FP8_KV), deploy, p, **speculation)) == []


def test_serve_options_outside_the_llm_api_are_named():
    from kiln.compiler.trtllm.rules.serve_options import check_serve_options

    problems = check_serve_options({
        "max_batch_size": 8,
        "kv_cache_config": {"dtype": "int8", "enable_block_reuse": True},
        "speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 0},
        "use_cuda_graph": True,
    })  # fmt: skip
    assert problems == [
        "use_cuda_graph: not an LLM API argument",
        "kv_cache_config.dtype 'int8': the PyTorch backend takes auto or fp8",
        "speculative_config.max_draft_len must be > 0 for DraftTarget",
    ]


def test_a_modelopt_fp8_artifact_is_ready_on_both_paths(tmp_path: Path, tiny_llama: Path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
name: tiny-modelopt-fp8
model:
  source: {tiny_llama}
quantization:
  method: fp8
  activations: fp8_static
  kv_cache: fp8
  backend: modelopt
calibration:
  dataset: builtin:licenses
  num_samples: 4
  max_seq_len: 32
report:
  num_samples: 4
  max_seq_len: 32
targets: [h100-sxm]
output: out
""")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    result = json.loads(stdout)  # ModelOpt's own prints go to stderr, not into the JSON
    assert result["targets"]["h100-sxm"] == {"engine": "planned", "pytorch": "ready"}
    served = Path(result["artifact"]) / "engines" / "h100-sxm" / "trtllm-serve.yaml"
    assert "dtype: fp8" in served.read_text()
