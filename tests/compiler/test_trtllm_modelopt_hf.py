"""llm-compressor checkpoints rewritten as ModelOpt's HF export for TensorRT-LLM's PyTorch
backend, proven without TensorRT-LLM.

`pytorch_backend_load` below reads a converted directory the way the backend's loader does
(tensorrt_llm/_torch/modules/linear.py and models/checkpoints/hf/weight_mapper.py): HF names
mapped to the fused qkv_proj / gate_up_proj, k/v weights repeated when tp exceeds the KV
heads, every tensor cut by `load_weight_shard` (ceil(width / tp) along the split dimension,
pre_quant_scale along the other one), shards concatenated, packed int4 transposed to
(in, out/2) bytes holding output columns 2c (low nibble) and 2c+1, group scales transposed to
(in/group, out). Dequantising that must give the quantiser's own weights exactly, rank by
rank. ModelOpt's own writer is the reference for names, dtypes, shapes and packing.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.compiler.trtllm.export.modelopt_hf import convert_to_modelopt_hf
from kiln.compiler.trtllm.rules.pytorch import check_hf_checkpoint
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import UsageError
from tests.compiler.test_trtllm_export import reference_weights

CALIBRATION = CalibrationSpec(num_samples=8, max_seq_len=64)
SPECS = {
    "fp8_kv": QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8"),
    "awq": QuantSpec(method="awq", weight_bits=4, group_size=64),
    "gptq": QuantSpec(method="gptq", weight_bits=4, group_size=64),
}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ALONE = {"o_proj": ("o_proj",), "down_proj": ("down_proj",)}


@pytest.fixture(scope="module")
def converted(
    tmp_path_factory, tiny_llama, tiny_qwen2, tiny_qwen3
) -> Callable[[str, str], tuple[Path, Path]]:
    """(arch, mode) → (the llm-compressor checkpoint, its ModelOpt HF conversion)."""
    models, made = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}, {}

    def get(arch: str, mode: str) -> tuple[Path, Path]:
        if (arch, mode) not in made:
            root = tmp_path_factory.mktemp(f"hf-{arch}-{mode}")
            quantize(models[arch], resolve(SPECS[mode]), CALIBRATION, root / "ct")
            convert_to_modelopt_hf(root / "ct", root / "hf")
            made[arch, mode] = (root / "ct", root / "hf")
        return made[arch, mode]

    return get


# ---- the PyTorch backend's loader, as its sources describe it ------------------------------


def _shard(t: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    """linear.py `load_weight_shard`: ceil(width / tp) slices; 1-d tensors are not cut on
    dim 1, and width-1 dimensions are not cut."""
    if tp == 1 or t.dim() == 0 or (t.dim() == 1 and dim == 1) or t.shape[dim] == 1:
        return t
    width = math.ceil(t.shape[dim] / tp)
    return t.narrow(dim, rank * width, min(width, t.shape[dim] - rank * width))


def _repeat_kv(t: torch.Tensor, kv_heads: int, tp: int) -> torch.Tensor:
    """weight_mapper.py `_duplicate_kv`: each KV head's rows repeated tp / kv_heads times."""
    if kv_heads >= tp:
        return t
    reps = tp // kv_heads
    if t.dim() == 1:
        return t.repeat_interleave(reps)
    per_head = t.reshape(kv_heads, 1, t.shape[0] // kv_heads, -1)
    return per_head.expand(kv_heads, reps, -1, -1).reshape(-1, t.shape[1])


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """(in, out/2) int8 bytes as preprocess_weights_for_mixed_gemm reads quint4x2: output
    column 2c in the low nibble, 2c+1 in the high one, two's complement."""
    data = packed.view(torch.uint8).to(torch.int16)
    codes = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(codes > 7, codes - 16, codes).to(torch.float32)


def _block(member: str) -> str:
    return "mlp" if member in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def pytorch_backend_load(model_dir: Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """(out, in) float32 weight of every fused/vanilla linear of layer 0 on `rank`, as the
    PyTorch backend would compute it from what it loads (before its own FP8 rescaling of
    q/k/v and gate/up to one scale, which it applies to ModelOpt's export alike)."""
    config = json.loads((model_dir / "config.json").read_text())
    quant = json.loads((model_dir / "hf_quant_config.json").read_text())["quantization"]
    algo, kv_heads = quant["quant_algo"], int(config["num_key_value_heads"])
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out = {}
    for fused, members in {**FUSED, **ALONE}.items():
        row = fused in ALONE
        weights, scales = [], []
        for member in members:
            prefix = f"model.layers.0.{_block(member)}.{member}"
            w, s = tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"]
            if member in ("k_proj", "v_proj"):
                w = _repeat_kv(w, kv_heads, tp)  # weight and bias only, never a scale
            weights.append(_shard(w, 1 if row else 0, tp, rank))
            scales.append(s if algo == "FP8" else _shard(s, 1 if row else 0, tp, rank))
            if algo == "W4A16_AWQ" and row:
                pqs = _shard(tensors[f"{prefix}.pre_quant_scale"], 0, tp, rank)
                assert torch.equal(pqs, torch.ones_like(pqs))
        if algo == "FP8":
            parts = [
                w.to(torch.float32) * s.reshape(()) for w, s in zip(weights, scales, strict=True)
            ]
            out[fused] = torch.cat(parts)
            continue
        codes = _unpack_columns(torch.cat(weights).to(torch.int8).T.contiguous())  # (in, out)
        scale = torch.cat(scales).T.to(torch.float32)  # (in/group, out)
        group = int(quant["group_size"])
        assert codes.shape[0] % group == 0  # W4A16_AWQ_LinearMethod.create_weights
        out[fused] = (codes * scale.repeat_interleave(group, dim=0)).T.contiguous()
    return out


def _reference_rank(
    reference: dict[str, torch.Tensor], kv_heads: int, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The quantiser's dequantised layer-0 weights cut the same way (float, so any error in
    layout or scale shows)."""
    out = {}
    for fused, members in {**FUSED, **ALONE}.items():
        parts = []
        for member in members:
            w = reference[f"model.layers.0.{_block(member)}.{member}.weight"]
            if member in ("k_proj", "v_proj"):
                w = _repeat_kv(w, kv_heads, tp)
            parts.append(_shard(w, 1 if fused in ALONE else 0, tp, rank))
        out[fused] = torch.cat(parts)
    return out


# ---- behaviour -------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("mode", list(SPECS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_pytorch_backend_would_load_the_quantisers_exact_weights(converted, arch, mode, tp):
    ct, hf = converted(arch, mode)
    problems = check_hf_checkpoint(hf, tp)
    if mode != "fp8_kv" and tp == 4:  # hidden 128, 2 KV heads, group 64
        assert any("exceeds the 2 KV heads" in p for p in problems)
        cut = any("o_proj has 128 input features, 32 per rank" in p for p in problems)
        assert cut == (arch != "qwen3")  # Qwen3's o_proj reads 4 heads of 64: 256 inputs
        return
    assert problems == []
    reference = reference_weights(ct)
    kv_heads = json.loads((hf / "config.json").read_text())["num_key_value_heads"]
    for rank in range(tp):
        loaded = pytorch_backend_load(hf, tp, rank)
        want = _reference_rank(reference, kv_heads, tp, rank)
        for name in want:
            assert loaded[name].shape == want[name].shape, name
            assert torch.equal(loaded[name], want[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_kv_cache_scales_move_to_modelopts_names_unchanged(converted, arch):
    ct, hf = converted(arch, "fp8_kv")
    with (
        safe_open(str(ct / "model.safetensors"), "pt") as a,
        safe_open(str(hf / "model.safetensors"), "pt") as b,
    ):
        for layer in range(2):
            for kind in "kv":
                src = a.get_tensor(f"model.layers.{layer}.self_attn.{kind}_scale")
                got = b.get_tensor(f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale")
                assert got.shape == () and got.dtype == torch.float32
                assert torch.equal(got, src.float().reshape(()))


def test_qwen2_biases_and_float_tensors_are_copied_as_stored(converted):
    ct, hf = converted("qwen2", "awq")
    with (
        safe_open(str(ct / "model.safetensors"), "pt") as a,
        safe_open(str(hf / "model.safetensors"), "pt") as b,
    ):
        for name in ("model.layers.0.self_attn.q_proj.bias", "model.norm.weight", "lm_head.weight"):
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_qwen3_head_norms_are_copied_float_and_read_by_the_loader(converted, tmp_path):
    ct, hf = converted("qwen3", "fp8_kv")
    names = [f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"]
    with (
        safe_open(str(ct / "model.safetensors"), "pt") as a,
        safe_open(str(hf / "model.safetensors"), "pt") as b,
    ):
        for name in names:
            assert b.get_tensor(name).shape == (64,)
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    assert check_hf_checkpoint(hf, 1) == []
    # The rules expect them: a checkpoint without one is refused, naming it.
    lost = tmp_path / "lost"
    shutil.copytree(hf, lost)
    tensors = load_file(lost / "model.safetensors")
    del tensors[names[0]]
    save_file(tensors, lost / "model.safetensors")
    assert any(names[0] in p for p in check_hf_checkpoint(lost, 1))


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (QuantSpec(method="awq", weight_bits=4, group_size=64, symmetric=False), "zero points"),
        (QuantSpec(method="gptq", weight_bits=8), "W8A16"),
        (QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic"), "FP8_PER"),
    ],
)
def test_schemes_that_do_not_map_one_to_one_are_refused(tiny_llama, tmp_path, spec, why):
    quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path / "ct")
    with pytest.raises(UsageError, match=why):
        convert_to_modelopt_hf(tmp_path / "ct", tmp_path / "hf")


def test_a_lost_tensor_or_a_wrong_shape_breaks_the_rules(converted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, hf = converted("llama", "awq")
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.pre_quant_scale"]
    tensors["model.layers.1.self_attn.q_proj.weight_scale"] = torch.ones(128, 1)
    save_file(tensors, str(broken / "model.safetensors"))
    problems = check_hf_checkpoint(broken, 1)
    assert "model.layers.0.mlp.down_proj.pre_quant_scale is required but not provided" in problems
    assert any(
        p.startswith("model.layers.1.self_attn.q_proj.weight_scale is F32[128, 1]")
        for p in problems
    )


# ---- ModelOpt's own writer as the reference ---------------------------------------------------


def test_int4_bytes_and_fp8_codes_are_modelopts_own_packing(converted):
    """ModelOpt's HF writer (quant_utils.py pack_int4_in_uint8 / to_quantized_weight) given
    the quantiser's dequantised weights and scales writes the very bytes we wrote."""
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8, to_quantized_weight

    for mode in ("awq", "gptq"):
        ct, hf = converted("llama", mode)
        reference = reference_weights(ct)
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            for module in ("self_attn.q_proj", "mlp.down_proj"):
                prefix = f"model.layers.1.{module}"
                scale = f.get_tensor(f"{prefix}.weight_scale").float()
                theirs = pack_int4_in_uint8(reference[f"{prefix}.weight"], scale, 64)
                assert torch.equal(f.get_tensor(f"{prefix}.weight"), theirs), (mode, module)
    ct, hf = converted("llama", "fp8_kv")
    reference = reference_weights(ct)
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        prefix = "model.layers.1.mlp.up_proj"
        theirs = to_quantized_weight(
            reference[f"{prefix}.weight"], f.get_tensor(f"{prefix}.weight_scale"), "fp8"
        )
        ours = f.get_tensor(f"{prefix}.weight")
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))


@pytest.fixture(scope="module")
def modelopt_hf_exports(tiny_llama, tmp_path_factory) -> Callable[[str], Path]:
    """ModelOpt's own export_hf_checkpoint of tiny_llama: FP8 + FP8 KV, INT4 AWQ group 64."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = AutoTokenizer.from_pretrained(tiny_llama)(text, return_tensors="pt")["input_ids"][0]
    batches = [ids[i * 64 : (i + 1) * 64][None] for i in range(4)]
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            if mode == "fp8_kv":
                cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
                kv = {"num_bits": (4, 3), "axis": None}
                cfg["quant_cfg"].append(
                    {"quantizer_name": "*[kv]_bmm_quantizer", "cfg": kv, "enable": True}
                )
            else:
                cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
                for entry in cfg["quant_cfg"]:
                    if entry.get("quantizer_name") == "*weight_quantizer":
                        entry["cfg"]["block_sizes"][-1] = 64
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            mtq.quantize(model, cfg, lambda m: [m(b) for b in batches])
            made[mode] = tmp_path_factory.mktemp(f"modelopt-{mode}")
            with torch.no_grad():
                export_hf_checkpoint(model, export_dir=made[mode])
        return made[mode]

    return get


def _layout(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in names}


@pytest.mark.parametrize("mode", ["fp8_kv", "awq"])
def test_names_dtypes_shapes_and_quant_config_equal_modelopts_export(
    mode, converted, modelopt_hf_exports
):
    _, ours = converted("llama", mode)
    theirs = modelopt_hf_exports(mode)
    assert _layout(ours) == _layout(theirs)
    quant_ours = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    quant_theirs = json.loads((theirs / "hf_quant_config.json").read_text())["quantization"]
    assert quant_ours == quant_theirs
    assert check_hf_checkpoint(theirs, 1) == []  # the rules were read from TensorRT-LLM


# ---- in `kiln compile` ------------------------------------------------------------------------


def test_compile_serves_an_llm_compressor_int4_artifact_on_the_pytorch_path(tmp_path, tiny_llama):
    """The conversion is written beside the report, then linked into the artifact: the files
    converting the artifact's `model/` gives, and nothing of it left in the output directory."""
    from kiln.runtime.formats import artifact
    from tests.compiler.test_compile import kiln, recipe_file

    recipe = recipe_file(tmp_path, tiny_llama, samples=4, seq=32, extra="targets: [l40s]\n")
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    assert "export: ModelOpt HF checkpoint for the PyTorch path" in stderr
    path = Path(json.loads(stdout)["artifact"])
    assert json.loads(stdout)["targets"]["l40s"]["pytorch"] == "ready"
    assert artifact.verify(path) == []  # the conversion is part of the digest
    assert check_hf_checkpoint(path / "trtllm" / "hf", 1) == []
    again = tmp_path / "again"
    convert_to_modelopt_hf(path / "model", again)
    ours = sorted(
        p.relative_to(path / "trtllm" / "hf") for p in (path / "trtllm" / "hf").rglob("*")
    )
    assert ours == sorted(p.relative_to(again) for p in again.rglob("*"))
    assert all((path / "trtllm" / "hf" / p).read_bytes() == (again / p).read_bytes()
               for p in ours if (again / p).is_file())  # fmt: skip
    assert not list(path.parent.glob(".pytorch-hf-*"))
    serve = (path / "engines" / "l40s" / "trtllm-serve.yaml").read_text()
    assert serve.startswith("# from the artifact directory: trtllm-serve trtllm/hf --backend")


def test_compile_names_the_tp_rule_the_pytorch_backend_would_break(tmp_path, tiny_llama):
    from tests.compiler.test_compile import kiln, recipe_file

    extra = "targets: [l40s]\ndeploy:\n  tp_size: 4\n  trtllm_path: pytorch\n"
    recipe = recipe_file(tmp_path, tiny_llama, samples=4, seq=32, extra=extra)
    code, stdout, _ = kiln("compile", str(recipe), "--json")
    assert code == 3
    status = json.loads(stdout)["targets"]["l40s"]["pytorch"]
    assert status.startswith("unsupported: conformance: tp=4 exceeds the 2 KV heads")


def test_validate_accepts_on_the_pytorch_path_exactly_the_schemes_that_convert():
    from kiln.compiler.trtllm.rules.support import check_target

    fp8_kv, awq = SPECS["fp8_kv"], QuantSpec(method="awq", weight_bits=4, group_size=128)
    assert check_target(resolve(fp8_kv), "h100-sxm", path="pytorch") == []
    assert check_target(resolve(awq), "l40s", path="pytorch") == []
    assert check_target(resolve(SPECS["gptq"]), "a100-80gb", path="pytorch") == []
    (why,) = check_target(resolve(QuantSpec(method="gptq", weight_bits=8)), "l40s", path="pytorch")
    assert "nor does kiln convert it exactly: W8A16 from compressed-tensors" in why.problem


def test_tied_embeddings_and_a_float_down_proj_convert_as_excluded_modules(tmp_path):
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    ignore = ("lm_head", r"re:model\.layers\.1\.mlp\.down_proj$")
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64, ignore=ignore)
    quantize(model, resolve(spec), CALIBRATION, tmp_path / "ct")
    section = convert_to_modelopt_hf(tmp_path / "ct", tmp_path / "hf")
    assert "model.layers.1.mlp.down_proj" in section["exclude_modules"]
    assert check_hf_checkpoint(tmp_path / "hf", 2) == []
    with (
        safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as a,
        safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as b,
    ):
        assert "lm_head.weight" not in set(b.keys())
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))
        assert "model.layers.1.mlp.down_proj.pre_quant_scale" not in set(b.keys())


def test_a_conversion_larger_than_a_shard_is_sharded_with_an_index(converted, tmp_path):
    ct, whole = converted("llama", "gptq")
    convert_to_modelopt_hf(ct, tmp_path, max_shard_bytes=300_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    single, held = load_file(whole / "model.safetensors"), {}
    for shard in shards:
        tensors = load_file(tmp_path / shard)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 300_000
        assert {index["weight_map"][name] for name in tensors} == {shard}
        held.update(tensors)
    assert held.keys() == single.keys()
    assert all(torch.equal(held[name], single[name]) for name in single)
    assert check_hf_checkpoint(tmp_path, 1) == []


def test_a_path_the_scheme_cannot_take_is_named_inside_the_artifact_not_its_staging(
    tmp_path, tiny_llama
):
    """W8A16 has no exact ModelOpt HF form: the PyTorch path's status names `model/` of the
    artifact, never the hidden staging directory it was judged in (gone once published)."""
    from kiln.runtime.formats import artifact
    from tests.compiler.test_compile import kiln

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"name: tiny-w8a16\nmodel:\n  source: {tiny_llama}\nquantization:\n  method: gptq\n"
        "  weight_bits: 8\n  group_size: null\ncalibration:\n  dataset: builtin:licenses\n"
        "  num_samples: 4\n  max_seq_len: 32\nreport:\n  num_samples: 2\n  max_seq_len: 32\n"
        f"targets: [l40s]\noutput: {tmp_path / 'out'}\n"
    )
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    status = json.loads(stdout)["targets"]["l40s"]["pytorch"]
    assert status.startswith("unsupported: model: W8A16 from compressed-tensors"), status
    manifest = artifact.load_manifest(json.loads(stdout)["artifact"])
    assert ".partial" not in json.dumps(manifest.to_dict()["targets"])


def test_the_conversion_plans_from_one_layer_of_a_model_whose_layers_are_alike(
    converted, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's plan walks each distinct decoder layer once (the others take its plan under
    their own names), so each quantised linear is read once to write it and layer 0's once
    more to plan; the files are the same bytes."""
    import kiln.compiler.trtllm.export.modelopt_hf as modelopt_hf

    ct, whole = converted("llama", "fp8_kv")
    read: list[str] = []
    real = modelopt_hf._linear

    def counted(ckpt: object, module: str, algo: str) -> dict[str, torch.Tensor]:
        read.append(module)
        return real(ckpt, module, algo)  # type: ignore[arg-type]

    monkeypatch.setattr(modelopt_hf, "_linear", counted)
    convert_to_modelopt_hf(ct, tmp_path)
    layers = json.loads((ct / "config.json").read_text())["num_hidden_layers"]
    first = [m for m in read if m.startswith("model.layers.0.")]
    assert len(first) == 7 * 2 and len(read) == 7 * layers + 7
    written = (tmp_path / "model.safetensors").read_bytes()
    assert written == (whole / "model.safetensors").read_bytes()
