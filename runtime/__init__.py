"""kiln's runtime: the artifact format and the serving engine.

Imports nothing else of ours and needs only torch, safetensors and a tokenizer library.
The engine names below load on first use, so `import runtime.errors` or `runtime.artifact`
(which every package does) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.async_engine import AsyncEngine as AsyncEngine
    from runtime.config import EngineConfig as EngineConfig
    from runtime.engine import Engine as Engine
    from runtime.outputs import EngineStats as EngineStats
    from runtime.outputs import RequestOutput as RequestOutput
    from runtime.sampling import Logprob as Logprob
    from runtime.sampling import SamplingParams as SamplingParams
    from runtime.speculative import SpeculativeConfig as SpeculativeConfig

_EXPORTS = {
    "AsyncEngine": "runtime.async_engine",
    "Engine": "runtime.engine",
    "EngineConfig": "runtime.config",
    "EngineStats": "runtime.outputs",
    "Logprob": "runtime.sampling",
    "RequestOutput": "runtime.outputs",
    "SamplingParams": "runtime.sampling",
    "SpeculativeConfig": "runtime.speculative",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
