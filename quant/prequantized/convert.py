"""Pre-quantised AutoAWQ / AutoGPTQ / GPTQModel checkpoints → compressed-tensors, no
recalibration (detect.py reads what one holds).

Thousands of published checkpoints use these formats while their libraries are dead, so the
conversion is ours (no maintained library converts them); compressed-tensors' own
`pack_to_int32` writes the result, so everything downstream reads it like llm-compressor output.
The layouts, read from each library's packing code:

- AutoAWQ GEMM (`quant_method: awq`, `version: gemm`): `qweight` int32 (in, out/8), where the
  4-bit field i of word j holds output column 8j + AWQ_ORDER[i]; `qzeros` int32 (in/g, out/8),
  same order; `scales` fp16 (in/g, out). w = (q − z) × s with q, z in [0, 15].
- AutoGPTQ / GPTQModel (`quant_method: gptq`): `qweight` int32 (in·b/32, out), packed along the
  input in natural order (field i of row r is input row r·32/b + i); `qzeros` int32
  (in/g, out·b/32), packed along the output; `scales` (in/g, out); `g_idx` (in,). Format `gptq`
  (v1) stores z − 1 (the kernels add 1 back); GPTQModel's `gptq_v2` stores z. Symmetric
  checkpoints carry z = 2^(b−1) everywhere.
- compressed-tensors `pack-quantized`: signed codes c = q − 2^(b−1) packed along the input,
  `weight_scale` (out, in/g), `weight_zero_point` z − 2^(b−1) packed along the output (dropped
  when symmetric), `weight_shape`. So c − zc = q − z: the dequantised values are bit-identical,
  and scales are copied bit for bit in their stored dtype.

Refused, because compressed-tensors cannot hold them exactly: AWQ GEMV / GEMV-fast / Marlin /
ExLlama packings, AWQ without zero points, GPTQ Marlin / BitBLAS / QQQ formats, 2- and 3-bit
codes, and GPTQ act-order (`desc_act: true`) with a g_idx permutation: compressed-tensors 0.19
dropped g_idx ("group" actorder) and TensorRT-LLM's groupwise kernel has no such layout.
`desc_act` with `static_groups` (trivial g_idx) converts.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant.prequantized.detect import PreQuantized, detect, read_config
from kiln.quant.registry import SCHEMES
from kiln.runtime.base.errors import SourceError
from kiln.runtime.formats.artifact import SchemeRecord

if TYPE_CHECKING:
    import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column of each 4-bit field in an AWQ GEMM word
# Tokenizer and generation files, copied verbatim.
_COPIED = ("tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
           "chat_template.*", "*.tiktoken", "generation_config.json")  # fmt: skip
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings")


def _unpack_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 (rows, words) → (rows, words·32/bits) unsigned fields, lowest bits first."""
    import torch

    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # mask undoes sign fill
    return fields.reshape(packed.shape[0], -1)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """Unpack an AWQ GEMM tensor (rows, cols/8) into natural column order (rows, cols)."""
    import torch

    fields = _unpack_fields(packed, 4)
    natural = torch.empty_like(fields)
    for i, column in enumerate(AWQ_ORDER):
        natural[:, column::8] = fields[:, i::8]
    return natural


@dataclass(frozen=True, slots=True)
class _Codes:
    """One linear in library terms: unsigned codes q (out, in), zero points z and scales s
    (out, groups); w = (q − z) × s."""

    q: torch.Tensor
    z: torch.Tensor
    s: torch.Tensor


def _read_linear(name: str, get: Any, pre: PreQuantized) -> _Codes:
    import torch

    qweight, qzeros, scales = get(f"{name}.qweight"), get(f"{name}.qzeros"), get(f"{name}.scales")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise SourceError(f"{name}: qweight/qzeros are {qweight.dtype}, not int32 words")
    bits, out = pre.bits, scales.shape[1]
    if pre.method == "awq":
        q, z = _awq_columns(qweight).t(), _awq_columns(qzeros).t()
    else:
        q = _unpack_fields(qweight.t().contiguous(), bits)  # (out, in)
        z = _unpack_fields(qzeros, bits).t()
        if pre.format == "gptq":
            z = z + 1  # v1 stores zero − 1
    in_features = q.shape[1]
    groups = 1 if pre.group_size is None else in_features // pre.group_size
    expected = (out, groups)
    if q.shape[0] != out or tuple(z.shape) != expected or scales.shape[0] != groups:
        raise SourceError(
            f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit {bits}-bit codes in groups of "
            f"{pre.group_size or in_features} (quantization_config disagrees with the tensors)"
        )
    g_idx = get(f"{name}.g_idx", None)
    if g_idx is not None:
        trivial = torch.arange(in_features) // (in_features // groups)
        if not torch.equal(g_idx.long(), trivial):
            raise SourceError(
                f"{name}: g_idx permutes input columns across groups (GPTQ act-order); "
                "compressed-tensors 0.19 and TensorRT-LLM cannot hold that layout exactly"
            )
    offset = 1 << (bits - 1)
    if pre.symmetric and not bool((z == offset).all()):
        raise SourceError(
            f"{name}: quantization_config says sym: true but the zero points are not all "
            f"{offset}; the checkpoint is inconsistent"
        )
    if int(z.max()) >= 1 << bits:
        raise SourceError(
            f"{name}: a {pre.format} zero point of {int(z.max())} does not fit {bits} bits "
            "(AutoGPTQ's v1 zero − 1 overflow); re-export with GPTQModel as gptq_v2"
        )
    return _Codes(q, z, scales.t().contiguous())


def _compressed(name: str, codes: _Codes, pre: PreQuantized) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors of one linear."""
    import torch
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    offset = 1 << (pre.bits - 1)
    signed = (codes.q - offset).to(torch.int8)
    out = {
        f"{name}.weight_packed": pack_to_int32(signed, pre.bits),
        f"{name}.weight_scale": codes.s,
        f"{name}.weight_shape": torch.tensor(list(codes.q.shape), dtype=torch.int64),
    }
    if not pre.symmetric:
        zero = (codes.z - offset).to(torch.int8)
        out[f"{name}.weight_zero_point"] = pack_to_int32(zero, pre.bits, packed_dim=0).contiguous()
    return out


def compressed_tensors_config(pre: PreQuantized, ignore: list[str]) -> dict[str, Any]:
    """The `quantization_config` llm-compressor writes for this W4A16/W8A16 scheme.

    Built with compressed-tensors' own config classes and laid out as its ModelCompressor
    writes it; `observer` stays null because no observer produced these values.
    """
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs as Args
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    weights = Args(
        num_bits=pre.bits,
        type="int",
        symmetric=pre.symmetric,
        strategy="channel" if pre.group_size is None else "group",
        group_size=pre.group_size,
        actorder="static" if pre.desc_act else None,  # static groups: llm-compressor's order
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, format="pack-quantized")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                quantization_status="compressed", ignore=ignore)  # fmt: skip
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **config.model_dump(exclude={"quant_method"}),
    }


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # repos sometimes also hold a consolidated copy beside the shards
        names = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(model_dir / name for name in names)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SourceError(
            f"{model_dir}: no *.safetensors weights; kiln imports pre-quantised checkpoints "
            "from safetensors only (re-save the .bin files as safetensors)"
        )
    return files


def convert(model_dir: Path, out_dir: Path) -> SchemeRecord:
    """Write the AWQ/GPTQ checkpoint in `model_dir` as compressed-tensors into `out_dir`.

    Codes, zero points and scales are carried over exactly; embeddings, norms, biases and
    unquantised linears are copied unchanged, one output shard per input shard. Returns the
    manifest's `scheme` record, shaped like `quant.quantize`'s.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_config(model_dir)
    pre = detect(config)
    if pre is None:
        raise SourceError(f"{model_dir}: config.json describes no AWQ or GPTQ checkpoint")
    files = _weight_files(model_dir)
    handles = [safe_open(str(f), "pt") for f in files]
    where = {key: h for h in handles for key in h.keys()}  # noqa: SIM118 (no __iter__)

    def get(key: str, *default: Any) -> Any:
        if default and key not in where:
            return default[0]
        return where[key].get_tensor(key)

    quantised = sorted(k.removesuffix(".qweight") for k in where if k.endswith(".qweight"))
    if not quantised:
        raise SourceError(f"{model_dir}: quantization_config says {pre.method} but no .qweight")
    ignore = sorted(
        k.removesuffix(".weight")
        for k in where
        if k.endswith(".weight")
        and len(where[k].get_slice(k).get_shape()) == 2
        and not k.removesuffix(".weight").endswith(_EMBEDDINGS)
    )
    if "lm_head" not in quantised and "lm_head" not in ignore:
        ignore = sorted([*ignore, "lm_head"])  # tied embedding: transformers still builds a Linear
    owned = {f"{m}.{t}" for m in quantised for t in ("qweight", "qzeros", "scales", "g_idx")}
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for path, handle in zip(files, handles, strict=True):
        name = "model.safetensors" if len(files) == 1 else path.name
        tensors: dict[str, torch.Tensor] = {}
        for key in handle.keys():  # noqa: SIM118
            if key.endswith(".qweight"):
                module = key.removesuffix(".qweight")
                tensors.update(_compressed(module, _read_linear(module, get, pre), pre))
            elif key not in owned:
                tensors[key] = handle.get_tensor(key)  # float parts, unchanged
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["quantization_config"] = compressed_tensors_config(pre, ignore)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for src in (f for pattern in _COPIED for f in model_dir.glob(pattern) if f.is_file()):
        shutil.copy2(src, out_dir / src.name)
    return _record(pre, ignore, time.perf_counter() - start)


def _record(pre: PreQuantized, ignore: list[str], seconds: float) -> SchemeRecord:
    from kiln.runtime.base.versions import versions

    definition = SCHEMES[pre.scheme]
    algo = dict(definition.trtllm)["none"]
    if pre.group_size is None and definition.trtllm_per_channel:
        algo = definition.trtllm_per_channel
    return SchemeRecord(
        scheme=pre.scheme,
        label=pre.scheme,
        backend="import",
        format="compressed-tensors",
        source_format=f"{pre.producer}-{pre.format}",
        trtllm_quant_algo=algo,
        trtllm_kv_cache_quant_algo=None,
        group_size=pre.group_size,
        symmetric=pre.symmetric,
        activations="none",
        kv_cache="none",
        ignore=ignore,
        versions=versions(("torch", "transformers", "compressed-tensors", "safetensors")),
        calibration=None,
        seconds=round(seconds, 3),
    )
