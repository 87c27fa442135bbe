"""The files of a Hugging Face checkpoint directory: config.json and lazily opened safetensors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.base.files import read_text, regular_problem


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.exists() and not path.is_symlink():
        raise ArtifactError(f"{model_dir}: no config.json; pass a Hugging Face model directory")
    return json.loads(read_text(path, ArtifactError))


def open_tensors(path: Path) -> Any:
    """A safetensors file opened to read its tensors one at a time, each into memory of its
    own: safetensors' default memory map keeps every page read resident until the file is
    closed, so reading a checkpoint through would hold all of it; `pread` holds only the
    tensors still in use (safetensors >= 0.7; the memory map before)."""
    try:
        return safe_open(str(path), framework="pt", backend="pread")
    except TypeError:
        return safe_open(str(path), framework="pt")


# transformers 5 saves a mixture of experts as its model holds it: Mixtral's sparse block under
# `mlp` (not `block_sparse_moe`), and each layer's experts fused, gate then up in
# `experts.gate_up_proj` [experts, 2 x width, hidden], `experts.down_proj` [experts, hidden,
# width]. Readers ask for the per-expert names every other writer uses; these are read from
# the fused tensors.
EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                    r"(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")  # fmt: skip
ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


class TensorFiles:
    """Lazy access to the tensors of one or more safetensors files (a mixture of experts saved
    fused, as transformers 5 saves it, read under the per-expert names too)."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ArtifactError(f"{model_dir}: no *.safetensors files; expected a HF checkpoint")
        self._where: dict[str, Any] = {}
        for path in files:
            if (why := regular_problem(path)) is not None:
                raise ArtifactError(f"{path}: {why}; a checkpoint holds regular files only")
            handle = open_tensors(path)
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._where[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where or self._fused(name) is not None

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is not None:
            return handle.get_tensor(name)
        fused = self._fused(name)
        if fused is None:
            raise ArtifactError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        stored, expert, half = fused
        if expert is None:
            return self._where[stored].get_tensor(stored)
        part = self._where[stored].get_slice(stored)[expert]
        if half is not None:
            rows = part.shape[0] // 2
            part = part[half * rows : (half + 1) * rows]
        return part.contiguous()

    def stored(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{name: (safetensors dtype, shape)} of every tensor as stored, read off the files'
        headers (no tensor is read)."""
        out = {}
        for name, handle in self._where.items():
            part = handle.get_slice(name)
            out[name] = (str(part.get_dtype()), tuple(int(d) for d in part.get_shape()))
        return out

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None

    def _fused(self, name: str) -> tuple[str, int | None, int | None] | None:
        """Where a per-expert weight, or Mixtral's router, is stored in transformers 5's layout:
        (the stored tensor, the expert or None, which half of gate_up_proj or None)."""
        if (router := ROUTER.match(name)) is not None:
            stored = f"{router.group(1)}.mlp.gate.weight"
            return (stored, None, None) if stored in self._where else None
        if (expert := EXPERT.match(name)) is None:
            return None
        layer, index, part = expert.groups()
        fused = "down_proj" if part in ("w2", "down_proj") else "gate_up_proj"
        stored = f"{layer}.mlp.experts.{fused}"
        handle = self._where.get(stored)
        if handle is None or int(index) >= handle.get_slice(stored).get_shape()[0]:
            return None
        return stored, int(index), HALF.get(part)
