"""ModelOpt's Hugging Face export (`modelopt.torch.export.export_hf_checkpoint`), read without
ModelOpt (transformers has no "modelopt" quantizer either).

On disk, as nvidia-modelopt 0.4x writes it:
- `hf_quant_config.json` {"quantization": {quant_algo, kv_cache_quant_algo, group_size,
  has_zero_point, pre_quant_scale, exclude_modules}}; config.json carries the same as
  `quantization_config` with quant_method "modelopt" (exclude_modules named `ignore`).
- A quantised linear is one with a `weight_scale`; codes are symmetric (w = code × scale):
  FP8: `weight` float8_e4m3fn, `weight_scale` () per tensor, static `input_scale` ().
  W8A8_SQ_PER_CHANNEL: `weight` int8, `weight_scale` [N], static int8 `input_scale` (),
  `pre_quant_scale` [K] (the SmoothQuant factor, applied to the input).
  W4A16_AWQ: `weight` uint8 [N/2, K], byte (r, c) holding the signed int4 codes of rows 2r
  (low nibble) and 2r+1 (high nibble) of column c; `weight_scale` [N, K/group];
  `pre_quant_scale` [K] where it was not folded into the preceding norm (o_proj, down_proj).
  W4A8_AWQ: W4A16_AWQ plus a static FP8 `input_scale` and a per-tensor `weight_scale_2`
  (ModelOpt: the FP8 quantiser's amax of the int4 weight / 448). The kernel multiplies FP8
  e4m3(code × scale / weight_scale_2), so that rounding is part of the served values
  (`served`, runtime/formats/w4a8.py); `linear` returns the int4 codes and group scales as stored.
  NVFP4: `weight` uint8 [N, K/2], two e2m1 codes per byte along K (runtime/formats/nvfp4.py),
  `weight_scale` float8_e4m3fn [N, K/16] per block of 16, `weight_scale_2` () per tensor
  (w = e2m1 × weight_scale × weight_scale_2), `input_scale` () the activations' global scale.
- FP8 KV cache: per layer `self_attn.k_proj.k_scale` and `self_attn.v_proj.v_scale` (),
  the scales that dequantise the cached keys and values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats import nvfp4, w4a8
from kiln.runtime.formats.weights import ActivationScheme, LinearWeights, WeightScheme, row_scales

if TYPE_CHECKING:
    from kiln.runtime.formats.checkpoint.files import TensorFiles

CONFIG_FILE = "hf_quant_config.json"
FP8_STATIC = ActivationScheme("float", 8, "tensor", dynamic=False)
INT8_STATIC = ActivationScheme("int", 8, "tensor", dynamic=False)
NVFP4_BLOCKS = ActivationScheme("float", 4, "group", dynamic=True)  # static global scale
# quant_algo → (how its weights are stored, the weight tensor's dtype on disk)
SCHEMES: dict[str, tuple[WeightScheme, torch.dtype]] = {
    "FP8": (WeightScheme("float", 8, "tensor", activations=FP8_STATIC), torch.float8_e4m3fn),
    "W8A8_SQ_PER_CHANNEL": (WeightScheme("int", 8, "channel", activations=INT8_STATIC), torch.int8),
    "W4A16_AWQ": (WeightScheme("int", 4, "group"), torch.uint8),
    "W4A8_AWQ": (WeightScheme("int", 4, "group", activations=FP8_STATIC), torch.uint8),
    "NVFP4": (
        WeightScheme("float", 4, "group", nvfp4.BLOCK, activations=NVFP4_BLOCKS),
        torch.uint8,
    ),
}
KV_CACHE = {"FP8": "fp8", "INT8": "int8"}


@dataclass(slots=True)
class ModelOptExport:
    """The quantisation a ModelOpt HF export records, and how to read its linears."""

    source: str
    quant_algo: str | None  # None: nothing quantised
    kv_cache: str | None = None  # "fp8" or "int8"
    group_size: int | None = None
    name: str = "modelopt"

    @classmethod
    def from_config(cls, data: dict[str, Any], model_dir: Path) -> ModelOptExport:
        path = model_dir / CONFIG_FILE
        if path.is_file():
            quant = json.loads(path.read_text())
            data = quant.get("quantization", quant)
        algo = data.get("quant_algo")
        algo = None if algo in (None, "NO_QUANT") else str(algo)
        kv_algo = data.get("kv_cache_quant_algo")
        if kv_algo is None and data.get("kv_cache_scheme"):  # config.json's spelling
            kv_algo = "FP8" if data["kv_cache_scheme"].get("type") == "float" else "INT8"
        if (algo is not None and algo not in SCHEMES) or kv_algo not in (None, *KV_CACHE):
            raise ArtifactError(
                f"{model_dir}: ModelOpt quant_algo {algo!r} with kv_cache_quant_algo "
                f"{kv_algo!r} is not read by kiln; it reads quant_algo {', '.join(SCHEMES)} "
                f"and KV caches {', '.join(KV_CACHE)} or none"
            )
        group = data.get("group_size")
        return cls(str(model_dir), algo, KV_CACHE.get(kv_algo or ""), group and int(group))

    def quantised(self, files: TensorFiles, module: str) -> bool:
        return self.quant_algo is not None and f"{module}.weight_scale" in files

    def linear(self, files: TensorFiles, module: str) -> LinearWeights:
        assert self.quant_algo is not None
        scheme, stored = SCHEMES[self.quant_algo]
        weight = files.get(f"{module}.weight")
        if weight.dtype != stored:
            raise ArtifactError(
                f"{self.source}: {module}.weight is {weight.dtype}, but quant_algo "
                f"{self.quant_algo} stores {stored}; the checkpoint is inconsistent"
            )
        if self.quant_algo == "NVFP4":  # e2m1 values; the global scale folds into the blocks'
            codes = nvfp4.unpack_e2m1(weight)
            scale = files.get(f"{module}.weight_scale").to(torch.float32)
            scale = scale * files.get(f"{module}.weight_scale_2").to(torch.float32)
        else:
            codes = unpack_int4_rows(weight) if stored == torch.uint8 else weight
            scale = row_scales(files.get(f"{module}.weight_scale"), codes.shape[0])
        if scheme.strategy == "group":
            size = self.group_size or codes.shape[1] // scale.shape[1]
            scheme = replace(scheme, group_size=size)
        input_scale = files.maybe(f"{module}.input_scale")
        if input_scale is not None:
            input_scale = input_scale.to(torch.float32).reshape(())
        pqs = files.maybe(f"{module}.pre_quant_scale")
        return LinearWeights(
            scheme,
            codes,
            scale,
            input_scale=input_scale,
            pre_quant_scale=None if pqs is None else pqs.to(torch.float32),
        )

    def served(self, files: TensorFiles, module: str, stored: LinearWeights) -> LinearWeights:
        if self.quant_algo != "W4A8_AWQ":
            return stored
        return w4a8.fp8_weights(stored, files.get(f"{module}.weight_scale_2"))

    def kv_scale_names(self, layer: int) -> tuple[str, str]:
        prefix = f"model.layers.{layer}.self_attn"
        return f"{prefix}.k_proj.k_scale", f"{prefix}.v_proj.v_scale"


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's packing, (out/2, in) bytes of two signed int4 output rows each → (out, in)
    int8 codes."""
    data = packed.view(torch.uint8).to(torch.int16)
    low, high = data & 0x0F, data >> 4
    codes = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(codes > 7, codes - 16, codes).to(torch.int8)
