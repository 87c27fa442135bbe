"""The files of a Hugging Face checkpoint directory: config.json and lazily opened safetensors."""

from __future__ import annotations

import json
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


class TensorFiles:
    """Lazy access to the tensors of one or more safetensors files."""

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
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise ArtifactError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return handle.get_tensor(name)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None
