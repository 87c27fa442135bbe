"""Installed versions of the distributions whose behaviour shapes kiln's outputs.

One lookup for every record that names its tools (the artifact manifest, the quantiser's
scheme record, gate verdicts, TensorRT-LLM checkpoints and engine stamps).
"""

from __future__ import annotations

import platform
from importlib import metadata

# What shapes an artifact: the compile stages' libraries.
COMPILE_TOOLS = (
    "kiln",
    "torch",
    "transformers",
    "llmcompressor",
    "compressed-tensors",
    "nvidia-modelopt",
    "safetensors",
)
# What shapes a gate's numbers.
GATE_TOOLS = ("kiln", "lm-eval", "torch", "transformers", "tokenizers", "compressed-tensors")


def version(*dists: str) -> str | None:
    """The installed version of the first of `dists` that is installed, else None."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions(dists: tuple[str, ...] | list[str], *, python: bool = False) -> dict[str, str]:
    """{distribution: version} for those of `dists` that are installed (plus Python's)."""
    out = {"python": platform.python_version()} if python else {}
    for dist in dists:
        found = version(dist)
        if found is not None:
            out[dist] = found
    return out


def kiln_version() -> str:
    """kiln's own version ("0+unknown" when run from a tree that is not installed)."""
    return version("kiln") or "0+unknown"
