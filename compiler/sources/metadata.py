"""What a source says about its model before any weights load: config.json or GGUF metadata.

The GGUF → config mapping is ours: the gguf package reads the fields, while transformers' own
mapping sits in private modules behind the full transformers import, which inspection avoids.
The mapped config is kept in the sidecar $XDG_CACHE_HOME/kiln/gguf-configs.json (see sidecar.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.compiler.sources.reference import BUILTIN, GGUF, SourceRef
from kiln.compiler.sources.sidecar import FileFacts
from kiln.quant.prequantized import detect as prequantized
from kiln.runtime.base.errors import SourceError
from kiln.runtime.base.files import read_text, regular_problem
from kiln.runtime.formats.model_info import ARCHITECTURES, ModelInfo

GGUF_SIDECAR = "gguf-configs.json"

# llama.cpp's architecture name → the transformers class it loads as: for the families kiln
# runs, llama.cpp's names are Hugging Face's model types. llama.cpp writes Mistral checkpoints
# as "llama", so a Mistral GGUF comes back as LlamaForCausalLM.
CAUSAL_LM_CLASSES = ARCHITECTURES


def inspect_source(ref: SourceRef) -> ModelInfo:
    """The model's shapes from its config.json or GGUF metadata; never reads weights."""
    if ref.kind in (GGUF, BUILTIN):
        try:
            config = gguf_config(ref.path)
        except (OSError, ValueError) as exc:
            raise SourceError(
                f"model.source {ref.spec!r}: {ref.path} is not a readable GGUF ({exc})"
            ) from None
        return _model_info(ref, config, f"{ref.path} metadata")
    config_path = ref.path / "config.json"
    try:
        config = prequantized.read_config(ref.path)  # AutoGPTQ may keep quantize_config.json apart
    except (OSError, json.JSONDecodeError) as exc:
        raise SourceError(
            f"model.source {ref.spec!r}: cannot read {config_path} ({exc}); "
            "point model.source at a complete Hugging Face checkpoint directory"
        ) from None
    return _model_info(ref, config, str(config_path))


def check_architecture(info: ModelInfo) -> list[str]:
    """Problems that stop kiln compiling this model (empty when it can).

    A pre-quantised AutoAWQ / AutoGPTQ / GPTQModel checkpoint is accepted (quant.prequantized
    converts it); any other quantised checkpoint is refused.
    """
    problems = info.unsupported()
    quantization = info.config.get("quantization_config")
    try:
        imported = prequantized.detect(
            info.config
        )  # AWQ / GPTQ checkpoints are converted, not refused
    except SourceError as exc:
        problems.append(exc.message)
    else:
        if quantization and imported is None:
            known = isinstance(quantization, dict)
            method = quantization.get("quant_method", "?") if known else "?"
            problems.append(
                f"the checkpoint is already quantised (quantization_config.quant_method={method}); "
                f"kiln imports only {prequantized.SUPPORTED} checkpoints — point model.source at "
                "one of those or at the float checkpoint it was made from"
            )
    if info.num_kv_heads <= 0 or info.num_heads % info.num_kv_heads:
        problems.append(
            f"num_attention_heads {info.num_heads} is not a multiple of num_key_value_heads "
            f"{info.num_kv_heads}; the config is damaged"
        )
    return problems


def weight_problems(ref: SourceRef) -> list[str]:
    """What is wrong with a checkpoint directory's safetensors files, found from their headers
    alone: a file cut short (a header promising more bytes than the file holds), a header that
    does not parse, or a shard the index names that is missing."""
    if ref.kind in (GGUF, BUILTIN):
        return []  # a GGUF's header, tensors included, was read by inspect_source
    from safetensors import SafetensorError, safe_open

    problems: list[str] = []
    for path in sorted(ref.path.glob("*.safetensors")):
        if (why := regular_problem(path)) is not None:
            problems.append(f"{path} is {why}; a checkpoint holds regular files only")
            continue
        try:
            with safe_open(str(path), framework="numpy"):
                pass  # opening checks the header and that the file covers every tensor
        except (OSError, SafetensorError) as exc:
            problems.append(f"{path} is damaged or truncated ({exc}); download or copy it again")
    index = ref.path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(read_text(index))["weight_map"].values())
        except (OSError, SourceError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [*problems, f"{index} does not parse ({type(exc).__name__}: {exc})"]
        missing = sorted(str(s) for s in shards if not (ref.path / str(s)).is_file())
        if missing:
            problems.append(f"{index} names missing weight files: {', '.join(missing)}")
    return problems


def _model_info(ref: SourceRef, config: dict[str, Any], origin: str) -> ModelInfo:
    try:
        return ModelInfo.from_hf_config(config)
    except ValueError as exc:
        raise SourceError(f"model.source {ref.spec!r}: {origin} has {exc}") from None


def gguf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict from a GGUF's metadata, remembered in a sidecar per file version.

    GGUFReader parses every metadata string (SmolLM2's 49k-token vocabulary takes 3-7 s here);
    preflight runs on every compile, so the result is kept while (path, size, mtime_ns) holds.
    """
    known = FileFacts(GGUF_SIDECAR)
    config = known.get(path)
    if not isinstance(config, dict):
        config = _read_gguf_config(path)
        known.put(path, config)
        known.save()
    return dict(config)


def _read_gguf_config(path: Path) -> dict[str, Any]:
    """`_parse_gguf`, with any failure of the parser on a damaged or hostile header (gguf raises
    KeyError, IndexError, struct.error, ... on one) as a ValueError naming it."""
    try:
        config = _parse_gguf(path)
        json.dumps(config)  # what the sidecar stores: plain values only
        return config
    except (OSError, ValueError):
        raise
    except Exception as exc:
        raise ValueError(f"malformed GGUF header: {type(exc).__name__}: {exc}") from None


def _parse_gguf(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(path)  # memory-maps the file; tensor data is never read

    def field(key: str, default: Any = None) -> Any:
        found = reader.get_field(key)
        return default if found is None else found.contents()

    arch = field("general.architecture")
    if not arch:
        raise ValueError("no general.architecture key")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    heads = field(f"{arch}.attention.head_count")
    if isinstance(heads, list):
        raise ValueError("per-layer head counts, which kiln does not compile")
    # Keys follow llama.cpp's `{arch}.*` naming; the values mirror the config transformers' GGUF
    # loader builds, so inspection agrees with the materialised checkpoint.
    config: dict[str, Any] = {
        "architectures": [CAUSAL_LM_CLASSES.get(arch, f"{arch} (GGUF)")],
        "model_type": arch,
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(f"{arch}.attention.key_length"),
        "max_position_embeddings": field(f"{arch}.context_length"),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(f"{arch}.rope.freq_base"),
        "vocab_size": len(tokens.data) if tokens is not None else field(f"{arch}.vocab_size"),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # what materialize writes
        "gguf_file_type": field("general.file_type"),
    }
    return {key: value for key, value in config.items() if value is not None}
