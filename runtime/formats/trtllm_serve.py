"""The spelling of an artifact's `trtllm-serve` options file per TensorRT-LLM version.

The options file (`engines/<target>/trtllm-serve.yaml`) is written at compile time and read
by whatever TensorRT-LLM serves the artifact later. One spelling has changed between lines:
the draft-target decoding type is `DraftTarget` in 1.2's LLM API and `"Draft_Target"` in the
PyTorch backend's strict union after it (shared/reference/TENSORRT_LLM.md, read from its
source). The compiler writes for the installed version (1.2 where none is), and the gate and
`kiln serve` respell a file for the version that reads it.
"""

from __future__ import annotations

from typing import Any

DRAFT_TARGET = {"1.2": "DraftTarget", "later": "Draft_Target"}


def trtllm_line(version: str | None) -> str:
    """Which spelling a TensorRT-LLM version takes: "1.2" (and older, or none installed),
    else "later"."""
    if version is None or version.startswith(("1.2.", "1.1.", "1.0.", "0.")):
        return "1.2"
    return "later"


def draft_target(version: str | None) -> str:
    """The draft-target `decoding_type` TensorRT-LLM `version` parses."""
    return DRAFT_TARGET[trtllm_line(version)]


def options_for_version(options: dict[str, Any], version: str | None) -> dict[str, Any]:
    """trtllm-serve options respelled for TensorRT-LLM `version`."""
    spec = options.get("speculative_config")
    if not isinstance(spec, dict) or spec.get("decoding_type") not in DRAFT_TARGET.values():
        return options
    return {**options, "speculative_config": {**spec, "decoding_type": draft_target(version)}}
