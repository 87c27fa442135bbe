"""One reader for Hugging Face checkpoints: float, compressed-tensors, and ModelOpt's HF export.

Hand-written: no installable library reads both quantised formats without the heavy
compile-time dependencies (compressed-tensors, ModelOpt) that a serving box does not have,
and transformers dequantises rather than handing over the codes. Every part of kiln that reads
a saved checkpoint's linears goes through here: the runtime's loader, the TensorRT-LLM export
and the quantisation report's reading of ModelOpt exports.

`open_checkpoint(dir)` reads config.json, picks the format from `quantization_config.
quant_method` (or ModelOpt's `hf_quant_config.json`) and returns a `Checkpoint`:
`linear(module)` decodes one projection into a `LinearWeights` (signed codes or FP8 values,
[N, groups] scales, zero points, static input scale, pre-quant scale) as stored,
`served_linear(module)` as the deployed kernel computes with it (what the runtime serves and
the quantisation report measures), `kv_cache` and
`kv_scales(layer)` describe a quantised KV cache, `tensor(name)` returns any other tensor as
stored. Each format's on-disk facts are in the module of its name beside this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats.checkpoint.compressed_tensors import CompressedTensors
from kiln.runtime.formats.checkpoint.files import TensorFiles, read_config
from kiln.runtime.formats.checkpoint.modelopt import CONFIG_FILE, ModelOptExport
from kiln.runtime.formats.weights import LinearWeights, WeightScheme

__all__ = ["Checkpoint", "QuantFormat", "TensorFiles", "open_checkpoint", "read_config"]

DENSE = WeightScheme()


class QuantFormat(Protocol):
    """How one checkpoint format stores quantised linears and KV-cache scales."""

    name: str
    quant_algo: str | None  # the algorithm the checkpoint records by name, if it does
    kv_cache: str | None  # "fp8", "int8" or None (the model's dtype)

    def quantised(self, files: TensorFiles, module: str) -> bool: ...

    def linear(self, files: TensorFiles, module: str) -> LinearWeights: ...

    def served(self, files: TensorFiles, module: str, stored: LinearWeights) -> LinearWeights:
        """`stored` (what `linear` decoded) as the deployed kernel computes with it."""
        ...

    def kv_scale_names(self, layer: int) -> tuple[str, str]: ...


@dataclass(slots=True)
class Float:
    """A checkpoint with no quantisation_config: every linear in float."""

    name: str = "float"
    quant_algo: str | None = None
    kv_cache: str | None = None

    def quantised(self, files: TensorFiles, module: str) -> bool:
        return False

    def linear(self, files: TensorFiles, module: str) -> LinearWeights:
        raise AssertionError("a float checkpoint has no quantised linear")

    def served(self, files: TensorFiles, module: str, stored: LinearWeights) -> LinearWeights:
        return stored

    def kv_scale_names(self, layer: int) -> tuple[str, str]:
        raise AssertionError("a float checkpoint has no KV-cache scales")


# quantization_config.quant_method → the format that reads it
FORMATS: dict[str, Callable[[dict[str, Any], Path], QuantFormat]] = {
    "compressed-tensors": CompressedTensors.from_config,
    "modelopt": ModelOptExport.from_config,
}


@dataclass(slots=True)
class Checkpoint:
    """A Hugging Face checkpoint directory, opened: its config, tensors and format."""

    dir: Path
    config: dict[str, Any]
    files: TensorFiles
    quant: QuantFormat = field(default_factory=Float)

    @property
    def format(self) -> str:
        return self.quant.name

    @property
    def kv_cache(self) -> str | None:
        return self.quant.kv_cache

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        return self.files.names()

    def tensor(self, name: str) -> torch.Tensor:
        return self.files.get(name)

    def is_quantised(self, module: str) -> bool:
        """Is the linear `module` stored quantised (rather than in float)?"""
        return self.quant.quantised(self.files, module)

    def has_linear(self, module: str) -> bool:
        return f"{module}.weight" in self.files or self.is_quantised(module)

    def linear(self, module: str) -> LinearWeights:
        """One linear's weights as stored: dense float, or codes with their scales."""
        bias = self.files.maybe(f"{module}.bias")
        if not self.is_quantised(module):
            return LinearWeights(DENSE, self.files.get(f"{module}.weight"), bias=bias)
        return replace(self.quant.linear(self.files, module), bias=bias)

    def served_linear(self, module: str) -> LinearWeights:
        """One linear as the deployed kernel computes with it: as stored, except where that
        kernel rounds the stored values once more (ModelOpt's W4A8 AWQ: runtime/formats/w4a8.py)."""
        stored = self.linear(module)
        if not self.is_quantised(module):
            return stored
        return self.quant.served(self.files, module, stored)

    def kv_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) scales that dequantise layer `layer`'s quantised KV cache."""
        if self.kv_cache is None:
            raise ArtifactError(f"{self.dir}: the checkpoint's KV cache is not quantised")
        k, v = self.quant.kv_scale_names(layer)
        return self.files.get(k), self.files.get(v)


def open_checkpoint(model_dir: Path) -> Checkpoint:
    """Open a Hugging Face checkpoint directory; raises ArtifactError naming it for a format
    kiln does not read."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    data = config.get("quantization_config") or {}
    method = data.get("quant_method")
    if method is None and (model_dir / CONFIG_FILE).is_file():
        method = "modelopt"
    quant: QuantFormat = Float()
    if data or method is not None:
        if method not in FORMATS:
            raise ArtifactError(
                f"{model_dir}: quantization_config.quant_method {method!r} is not supported "
                f"by the kiln runtime (it reads {' and '.join(FORMATS)} checkpoints)"
            )
        quant = FORMATS[method](data, model_dir)
    return Checkpoint(model_dir, config, TensorFiles(model_dir), quant)
