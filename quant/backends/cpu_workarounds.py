"""Patches that let the quantisation libraries run on a machine without an accelerator.

Every workaround lives here, is applied only for the duration of a `with` block, and only
when no accelerator is present, so a GPU run is untouched.

llm-compressor 0.14 AWQ: `AWQModifier._apply_smoothing` (modifiers/transform/awq/base.py)
calls `IntermediatesCache.pin_memory` (pipelines/cache.py) on every cached batch before its
grid search, unconditionally. `Tensor.pin_memory()` needs an accelerator, so on a CPU-only
machine AWQ stops with "Cannot access accelerator device when none is available". Pinning
only speeds up host-to-device copies, which a CPU run never makes, so skipping it changes
nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def llmcompressor_on_cpu() -> Iterator[None]:
    """Within the block, make llm-compressor's intermediates cache skip pinning on CPU."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory

    def skip_pinning(self: IntermediatesCache, *args: object, **kwargs: object) -> None:
        return None

    IntermediatesCache.pin_memory = skip_pinning  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]
