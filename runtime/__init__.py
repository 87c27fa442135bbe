"""kiln's runtime: the artifact format and the serving engine.

Imports nothing else of ours and needs only torch, safetensors and a tokenizer library.
The engine names below load on first use, so `import kiln.runtime.base.errors` or
`kiln.runtime.formats.artifact` (which every package does) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.runtime.engine.async_engine import AsyncEngine as AsyncEngine
    from kiln.runtime.engine.config import EngineConfig as EngineConfig
    from kiln.runtime.engine.core import Engine as Engine
    from kiln.runtime.engine.outputs import EngineStats as EngineStats
    from kiln.runtime.engine.outputs import RequestOutput as RequestOutput
    from kiln.runtime.engine.sampling import Logprob as Logprob
    from kiln.runtime.engine.sampling import SamplingParams as SamplingParams
    from kiln.runtime.engine.spec_decode.speculator import SpeculativeConfig as SpeculativeConfig

_EXPORTS = {
    "AsyncEngine": "kiln.runtime.engine.async_engine",
    "Engine": "kiln.runtime.engine.core",
    "EngineConfig": "kiln.runtime.engine.config",
    "EngineStats": "kiln.runtime.engine.outputs",
    "Logprob": "kiln.runtime.engine.sampling",
    "RequestOutput": "kiln.runtime.engine.outputs",
    "SamplingParams": "kiln.runtime.engine.sampling",
    "SpeculativeConfig": "kiln.runtime.engine.spec_decode.speculator",
}

__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__`: each name of `exports` is imported from the module
    it maps to on first use, so importing the package itself stays cheap."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


__getattr__ = lazy_exports(__name__, _EXPORTS)
