"""Rewrite an llm-compressor (compressed-tensors) checkpoint as ModelOpt's HF export, the
format TensorRT-LLM's PyTorch backend loads quantised checkpoints from.

`convert_to_modelopt_hf(model_dir, out_dir)` moves every value one to one: no code, scale or
weight is recomputed, so the dequantised weights are exactly the quantiser's. What it cannot
move that way it refuses (`UsageError`, the `unsupported: <why>` of the path). Hand-written:
ModelOpt's `export_hf_checkpoint` exports only a live ModelOpt-quantised model, and nothing
else writes this format. The layouts are the ones compiler/trtllm/rules/pytorch.py states (with
their TensorRT-LLM and ModelOpt sources); `check_hf_checkpoint` there proves what this writes.

- FP8 per tensor, static input scale: `weight` float8_e4m3fn as stored, `weight_scale` and
  `input_scale` as 0-d float32 (the same numbers: compressed-tensors and ModelOpt both
  dequantise as code × scale and quantise the input as x / input_scale).
- W4A16 group-wise (AWQ, GPTQ without activation reordering), symmetric: the signed int4
  codes packed two output rows per byte (ModelOpt's `pack_int4_in_uint8`), `weight_scale`
  (out, in/group) in its stored dtype, and on o_proj/down_proj a `pre_quant_scale` of ones,
  which the loader requires there: llm-compressor's AWQ folds its smoothing into the weights,
  so the factor is exactly 1. Zero points (asymmetric groups) and GPTQ's g_idx have no place
  in TensorRT-LLM's W4A16 AWQ layer and are refused.
- FP8 KV cache: compressed-tensors' `self_attn.k_scale`/`v_scale` (amax / 448, the
  dequantising scale) become ModelOpt's `self_attn.k_proj.k_scale`/`v_proj.v_scale`.
Everything else (embeddings, norms, float linears, Qwen2's q/k/v biases) is copied as stored;
float decoder linears, the embedding and lm_head are listed in `exclude_modules`.

The weights are read and written a decoder layer at a time, in shards of at most 5 GB with
their index (one `model.safetensors` below that; runtime/formats/safetensors_writer.py), so the
conversion holds about one layer; the tokenizer and the other files it takes as they are are
hard links to the source's where the filesystem allows (stored once in an artifact).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.trtllm.export.linears import pack_int4_rows
from kiln.compiler.trtllm.export.source import layer_signatures, trtllm_algo
from kiln.compiler.trtllm.rules.pytorch import (
    CONVERTS,
    QUANT_CONFIG_FILE,
    conversion_problem,
    float_expert_blocks,
    hf_linears,
)
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.heap import reuse_within_layers
from kiln.runtime.base.versions import kiln_version
from kiln.runtime.formats.checkpoint import Checkpoint, open_checkpoint
from kiln.runtime.formats.checkpoint.compressed_tensors import CompressedTensors
from kiln.runtime.formats.model_info import ModelInfo, with_legacy_rope
from kiln.runtime.formats.safetensors_writer import (
    SHARD_BYTES,
    Tensors,
    TensorSpec,
    Unit,
    in_file,
    plan_by_unit,
    save_sharded,
)
from kiln.runtime.formats.weights import LinearWeights

NOT_COPIED = ("config.json", "recipe.yaml", QUANT_CONFIG_FILE)


def _int4(module: str, lin: LinearWeights) -> dict[str, torch.Tensor]:
    if lin.zero_point is not None:
        raise UsageError(
            f"{module}: asymmetric int4 groups (zero points) have no place in TensorRT-LLM's "
            "W4A16 AWQ layer; quantise with quantization.symmetric: true"
        )
    if lin.g_idx is not None:
        raise UsageError(
            f"{module}: GPTQ activation reordering (g_idx) has no place in TensorRT-LLM's "
            "W4A16 AWQ layer; quantise without actorder"
        )
    if lin.out_features % 2:
        raise UsageError(f"{module}: {lin.out_features} output rows cannot pack two per byte")
    return {f"{module}.weight": pack_int4_rows(lin.weight).view(torch.uint8)}


def _fp8(module: str, lin: LinearWeights) -> dict[str, torch.Tensor]:
    if lin.input_scale is None:
        raise UsageError(
            f"{module}: FP8 without a static input scale is not ModelOpt's FP8; use "
            "activations: fp8_static"
        )
    return {
        f"{module}.weight": lin.weight,
        f"{module}.input_scale": lin.input_scale.to(torch.float32).reshape(()),
    }


def _linear(ckpt: Checkpoint, module: str, algo: str) -> dict[str, torch.Tensor]:
    """One quantised projection in ModelOpt's layout; UsageError where it does not map."""
    lin = ckpt.linear(module)
    scheme = lin.scheme
    stored_scale = ckpt.tensor(f"{module}.weight_scale")
    if algo == "FP8":
        if scheme.type != "float" or scheme.strategy != "tensor":
            raise UsageError(f"{module}: {scheme.strategy} FP8 is not per-tensor FP8")
        out = _fp8(module, lin)
        out[f"{module}.weight_scale"] = stored_scale.to(torch.float32).reshape(())
    else:
        if scheme.type != "int" or scheme.num_bits != 4 or scheme.strategy != "group":
            raise UsageError(
                f"{module}: {scheme.num_bits}-bit {scheme.strategy} is not int4 groups"
            )
        out = _int4(module, lin)
        out[f"{module}.weight_scale"] = stored_scale.reshape(lin.out_features, -1).contiguous()
    if lin.bias is not None:
        out[f"{module}.bias"] = lin.bias
    return out


def _owned(ckpt: Checkpoint, modules: set[str]) -> set[str]:
    """Source tensor names that the quantised `modules` and the KV-cache scales account for."""
    owned = set()
    for name in ckpt.names():
        module, _, leaf = name.rpartition(".")
        if module in modules or leaf in ("k_scale", "v_scale"):
            owned.add(name)
    return owned


def convert_to_modelopt_hf(
    model_dir: Path, out_dir: Path, *, max_shard_bytes: int = SHARD_BYTES
) -> dict[str, Any]:
    """Write `model_dir` (compressed-tensors) to `out_dir` as a ModelOpt HF checkpoint, in
    shards of at most `max_shard_bytes`; returns its `quantization` section. UsageError names
    what does not map exactly."""
    ckpt = open_checkpoint(Path(model_dir))
    quant = ckpt.quant
    if not isinstance(quant, CompressedTensors) or len(quant.groups) != 1:
        raise UsageError(
            f"{model_dir}: only a single-group compressed-tensors checkpoint converts to "
            "ModelOpt's HF format"
        )
    group = quant.groups[0]
    source_algo = trtllm_algo(group.weights, group.actorder)
    kv_algo = ckpt.kv_cache.upper() if ckpt.kv_cache else None
    why = conversion_problem(
        source_algo,
        kv_algo,
        symmetric=group.weights.symmetric,
        group_size=group.weights.group_size,
    )
    if why is not None:
        raise UsageError(f"{model_dir}: {why}")
    algo = CONVERTS[source_algo]
    config = dict(ckpt.config)
    quantised = [lin.name for lin in hf_linears(config) if ckpt.is_quantised(lin.name)]
    excluded = ["lm_head", "model.embed_tokens"] + [
        lin.name for lin in hf_linears(config) if lin.name not in quantised
    ]
    excluded += float_expert_blocks(config, set(excluded))
    section: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": kv_algo}
    ones_dtype = None
    if algo == "W4A16_AWQ":
        ones_dtype = ckpt.tensor("model.norm.weight").dtype
        section.update(
            group_size=group.weights.group_size, has_zero_point=False, pre_quant_scale=True
        )
    section["exclude_modules"] = excluded

    units = _units(ckpt, quantised, algo, kv_algo is not None, ones_dtype)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for unit in units.values():
            yield from unit()

    def planned() -> dict[str, TensorSpec]:
        # each distinct decoder layer walked once (the others named from it), as the
        # TensorRT-LLM export plans: the conversion moves values by name and stored shape
        signatures = layer_signatures(ckpt, ModelInfo.from_hf_config(ckpt.config))

        def one_file(
            produce: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        ) -> Callable[[], Tensors]:
            return lambda: in_file("", produce(), {})

        keyed: list[Unit] = [
            (None if layer is None else signatures[layer],
             "" if layer is None else f"model.layers.{layer}.", one_file(produce))
            for layer, produce in units.items()
        ]  # fmt: skip
        return plan_by_unit(keyed).get("", {})

    reuse_within_layers()  # layers are read and freed one after another (the writer trims)
    _write(Path(model_dir), Path(out_dir), config, section, tensors, max_shard_bytes, planned)
    return section


def _layer_of(name: str) -> int | None:
    """The decoder layer a tensor or module belongs to (None: embedding, final norm, lm_head)."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _units(
    ckpt: Checkpoint,
    quantised: list[str],
    algo: str,
    kv_cache: bool,
    ones_dtype: torch.dtype | None,
) -> dict[int | None, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Every tensor of the conversion, a decoder layer at a time (each layer's producer, then
    the rest of the model's under None): the quantised linears in ModelOpt's layout (W4A16_AWQ:
    with the pre-quant scale of ones the loader requires on o_proj and down_proj, in
    `ones_dtype`), everything else as stored."""
    rest: dict[int | None, list[str]] = {}
    for name in sorted(set(ckpt.names()) - _owned(ckpt, set(quantised))):
        rest.setdefault(_layer_of(name), []).append(name)
    modules: dict[int | None, list[str]] = {}
    for module in quantised:
        modules.setdefault(_layer_of(module), []).append(module)

    def unit(layer: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        for module in modules.get(layer, []):
            out = _linear(ckpt, module, algo)
            if ones_dtype is not None and module.endswith(("o_proj", "down_proj")):
                columns = int(out[f"{module}.weight"].shape[1])
                out[f"{module}.pre_quant_scale"] = torch.ones(columns, dtype=ones_dtype)
            yield from out.items()
            del out
        for name in rest.get(layer, []):
            yield name, ckpt.tensor(name)
        if kv_cache and layer is not None:
            k, v = ckpt.kv_scales(layer)
            prefix = f"model.layers.{layer}.self_attn"
            yield f"{prefix}.k_proj.k_scale", k.to(torch.float32).reshape(())
            yield f"{prefix}.v_proj.v_scale", v.to(torch.float32).reshape(())

    layers = int(ckpt.config["num_hidden_layers"])
    return {layer: functools.partial(unit, layer) for layer in [*range(layers), None]}


def _write(
    src: Path,
    out: Path,
    config: dict[str, Any],
    section: dict[str, Any],
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    max_shard_bytes: int,
    planned: Callable[[], dict[str, TensorSpec]],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # tokenizer, generation config, chat template
        if path.is_file() and path.name not in NOT_COPIED and "safetensors" not in path.name:
            _link_or_copy(path, out / path.name)
    producer = {"name": "kiln", "version": kiln_version()}
    hf_quant = {"producer": producer, "quantization": section}
    (out / QUANT_CONFIG_FILE).write_text(json.dumps(hf_quant, indent=2) + "\n")
    # config.json carries the same, as ModelOpt's writer does, under quant_method "modelopt"
    # (TensorRT-LLM's from_pretrained prefers hf_quant_config.json; kiln's reader reads both).
    inline = {
        "quant_method": "modelopt",
        "quant_algo": section["quant_algo"],
        "kv_cache_quant_algo": section["kv_cache_quant_algo"],
        "ignore": section["exclude_modules"],
        "producer": producer,
    }
    if "group_size" in section:
        inline["group_size"] = section["group_size"]
    # RoPE spelled for transformers 4.57 too, which TensorRT-LLM 1.2 reads config.json with.
    spelled = with_legacy_rope({**config, "quantization_config": inline})
    (out / "config.json").write_text(json.dumps(spelled, indent=2) + "\n")
    save_sharded(out, tensors, metadata={"format": "pt"}, max_shard_bytes=max_shard_bytes,
                 specs=planned())  # fmt: skip


def _link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` (one copy on disk where both land in one artifact), or a
    copy across filesystems. Nothing kiln writes is edited in place, so sharing is safe."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
