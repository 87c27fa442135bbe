"""What kiln writes for TensorRT-LLM is bounded by a layer, not by the model, and stored once.

The safetensors files are streamed tensor by tensor and come out byte for byte as
`safetensors.torch.save_file` writes them; Hugging Face checkpoints are sharded with an index;
the export and the ModelOpt HF conversion of a few-hundred-MB checkpoint, each run in a
subprocess of its own, peak at a fraction of the checkpoint's size above the process's
baseline; the PyTorch path compiles without a TensorRT-LLM checkpoint; and an artifact holds
identical files once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.runtime.formats import artifact
from kiln.runtime.formats.safetensors_writer import (
    DTYPES,
    INDEX_FILE,
    plan,
    plan_by_unit,
    save_sharded,
    write_files,
)
from tests.compiler.test_compile import kiln, recipe_file


def every_dtype() -> dict[str, torch.Tensor]:
    """Tensors of every dtype safetensors stores (bf16, f16, f32, int8, uint8, float8_e4m3fn
    and int32 among them), several per dtype, 0-d and empty ones included."""
    generator = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate([(5, 3), (), (0, 4), (17,)]):
            values = torch.randint(0, 2 if dtype == torch.bool else 100, shape, generator=generator)
            out[f"layers.{(7 * i + j) % 11}.{str(dtype)[6:]}.{j}"] = values.to(dtype)
    return out


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_streamed_file_is_byte_identical_to_save_file(tmp_path, metadata):
    tensors = every_dtype()
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata=metadata)
    order = list(tensors.items())
    random.Random(0).shuffle(order)  # made in any order, laid out as save_file lays it out
    write_files(tmp_path, lambda: (("ours.safetensors", n, t) for n, t in order), metadata)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "theirs.safetensors").read_bytes()
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert back.keys() == tensors.keys()
    for name, tensor in tensors.items():  # bit for bit (float8 has no torch.equal)
        assert (back[name].dtype, back[name].shape) == (tensor.dtype, tensor.shape)
        assert torch.equal(bits(back[name]), bits(tensor)), name


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_a_producer_that_changes_between_passes_is_refused(tmp_path):
    passes = iter([torch.zeros(4), torch.zeros(5)])

    def produce():
        yield "f.safetensors", "w", next(passes)

    with pytest.raises(ValueError, match="planned as"):
        write_files(tmp_path, produce)


def test_units_alike_are_planned_once_and_a_unit_that_differs_is_refused(tmp_path):
    """`plan_by_unit` runs one producer per key and names the others' tensors from its plan;
    the write still checks every tensor against the plan, so a unit whose key hid a
    difference fails loudly rather than writing a wrong layout."""
    ran: list[int] = []

    def layer(i: int, width: int = 4):
        ran.append(i)
        yield "f.safetensors", f"layers.{i}.w", torch.full((width,), float(i))
        yield "f.safetensors", f"layers.{i}.b", torch.zeros(2, dtype=torch.bfloat16)

    def units(widths: list[int]):
        yield None, "", lambda: iter([("f.safetensors", "head", torch.ones(3))])
        for i, width in enumerate(widths):
            yield "alike", f"layers.{i}.", lambda i=i, width=width: layer(i, width)

    planned = plan_by_unit(units([4, 4, 4]))
    assert ran == [0]
    ran.clear()
    assert planned == plan(units_tensors(units([4, 4, 4])))
    write_files(tmp_path, lambda: units_tensors(units([4, 4, 4])), specs=planned)
    assert set(load_file(str(tmp_path / "f.safetensors"))) == {
        "head",
        *(f"layers.{i}.{p}" for i in range(3) for p in "wb"),
    }
    with pytest.raises(ValueError, match="planned as"):
        write_files(tmp_path, lambda: units_tensors(units([4, 5, 4])),
                    specs=plan_by_unit(units([4, 5, 4])))  # fmt: skip


def units_tensors(units):
    for _, _, produce in units:
        yield from produce()


def test_a_checkpoint_larger_than_a_shard_is_sharded_with_an_index(tmp_path):
    tensors = {f"model.layers.{i}.weight": torch.full((250,), float(i)) for i in range(6)}
    files = save_sharded(tmp_path, lambda: iter(tensors.items()), max_shard_bytes=2500)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files == [*shards, INDEX_FILE]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"] == {"total_size": 6000}
    for shard in shards:
        assert (tmp_path / shard).stat().st_size <= 2500 + 1024  # data, plus the header
        held = load_file(str(tmp_path / shard))
        assert {index["weight_map"][n] for n in held} == {shard}
        assert all(torch.equal(t, tensors[n]) for n, t in held.items())
    assert set(index["weight_map"]) == set(tensors)


def test_a_checkpoint_within_one_shard_is_one_model_safetensors(tmp_path):
    tensors = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    assert save_sharded(tmp_path, lambda: iter(tensors.items())) == ["model.safetensors"]
    assert not (tmp_path / INDEX_FILE).exists()
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    theirs = (tmp_path / "theirs.safetensors").read_bytes()
    assert (tmp_path / "model.safetensors").read_bytes() == theirs


# ---- peak memory of the export and the conversion ---------------------------------------

# A random Llama with FP8 (per-tensor, static activations) linears as llm-compressor stores
# them, and bf16 embedding, lm_head and norms: 24 layers of 15 MB, 33 MB each for the embedding
# and lm_head, ~430 MB in all. A copy of the model shows; one layer or one embedding does not.
HIDDEN, LAYERS, INTER, VOCAB, HEADS, KV_HEADS = 1024, 24, 4096, 16000, 16, 4
FP8 = {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}
# Peak above the baseline, as a share of the checkpoint's bytes. Holding the checkpoint in
# memory (as the export did, with every rank's tensors besides) needs more than 1.
MAX_PEAK_SHARE = 0.35


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint above, written a layer per file (this process never holds it whole)."""
    out = tmp_path_factory.mktemp("fp8-llama")
    generator = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS
    kv = KV_HEADS * head_dim
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (kv, HIDDEN),
              "self_attn.v_proj": (kv, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
              "mlp.down_proj": (HIDDEN, INTER)}  # fmt: skip

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    head = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN).bfloat16(),
        "lm_head.weight": normal(VOCAB, HIDDEN).bfloat16(),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    save_file(head, str(out / "head.safetensors"), metadata={"format": "pt"})
    del head
    for i in range(LAYERS):
        prefix, tensors = f"model.layers.{i}", {}
        for name, shape in shapes.items():
            weight = normal(*shape)
            scale = weight.abs().max() / 448
            tensors[f"{prefix}.{name}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.{name}.weight_scale"] = scale.reshape(1)
            tensors[f"{prefix}.{name}.input_scale"] = torch.tensor([0.01])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        save_file(tensors, str(out / f"layer-{i:02d}.safetensors"), metadata={"format": "pt"})
    group = {"targets": ["Linear"], "format": "float-quantized", "weights": FP8,
             "input_activations": FP8}  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                "config_groups": {"group_0": group}, "ignore": ["lm_head"]},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# Run in a process of its own: its peak resident memory above what it held once python, torch
# and kiln were imported. Read as VmHWM, the high-water mark of this program's own memory: Linux
# starts a child's ru_maxrss (RUSAGE_SELF, and the parent's RUSAGE_CHILDREN) at the spawning
# process's own peak, so a test process bigger than the export would hide the export's.
MEASURE = """
import json, re, sys
from pathlib import Path
from kiln.compiler.trtllm.export.modelopt_hf import convert_to_modelopt_hf
from kiln.compiler.trtllm.export.writer import export_checkpoint

def high_water():
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmHWM:\\s+(\\d+) kB", status, re.M).group(1)) * 1024

what, src, out, tp = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
baseline = high_water()
if what == "export":
    export_checkpoint(src, out, tp_size=tp)
else:
    convert_to_modelopt_hf(src, out)
print(json.dumps({"baseline": baseline, "peak": high_water()}))
"""


def peak_share(what: str, model: Path, out: Path, tp: int = 1) -> float:
    """The peak memory of `what` (export, convert) of `model` above its process's baseline,
    as a share of the checkpoint's bytes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", MEASURE, what, str(model), str(out), str(tp)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.splitlines()[-1])
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    return (measured["peak"] - measured["baseline"]) / size


@pytest.mark.parametrize("tp", [1, 2])
def test_export_holds_a_layer_not_the_model(fp8_checkpoint, tmp_path, tp):
    assert peak_share("export", fp8_checkpoint, tmp_path / "trtllm", tp) < MAX_PEAK_SHARE


def test_modelopt_hf_conversion_holds_a_layer_not_the_model(fp8_checkpoint, tmp_path):
    assert peak_share("convert", fp8_checkpoint, tmp_path / "hf") < MAX_PEAK_SHARE


# ---- an artifact for the PyTorch path ----------------------------------------------------


@pytest.fixture(scope="module")
def pytorch_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """tiny_llama as GPTQ int4 (converted to ModelOpt's HF form in `trtllm/hf/`) for an L40S
    on the PyTorch path alone."""
    tmp = tmp_path_factory.mktemp("pytorch-path")
    extra = "targets: [l40s]\ndeploy:\n  trtllm_path: pytorch\n"
    recipe = recipe_file(tmp, tiny_llama, samples=4, seq=32, extra=extra)
    code, stdout, stderr = kiln("compile", str(recipe), "--json")
    assert code == 0, stderr
    return Path(json.loads(stdout)["artifact"])


def test_the_pytorch_path_exports_no_tensorrt_llm_checkpoint_and_says_so(pytorch_artifact):
    manifest = artifact.load_manifest(pytorch_artifact)
    assert not any(stage.startswith("export") for stage in manifest.stages)
    assert not (pytorch_artifact / "trtllm" / "tp1").exists()
    target = manifest.targets["l40s"]
    assert (target.engine, target.pytorch) == ("skipped: deploy.trtllm_path is pytorch", "ready")
    assert target.export is not None and target.export.unsupported is not None
    assert target.export.unsupported.startswith("not exported: deploy.trtllm_path is pytorch")
    code, stdout, _ = kiln("inspect", str(pytorch_artifact), "--verify")
    assert code == 0 and "all digests match" in stdout


def test_identical_files_are_stored_once(pytorch_artifact):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        ours, model = pytorch_artifact / "trtllm" / "hf" / name, pytorch_artifact / "model" / name
        assert ours.read_bytes() == model.read_bytes()
        assert os.path.samefile(ours, model), name
    assert artifact.verify(pytorch_artifact) == []
