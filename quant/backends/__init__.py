"""Quantisation backends, one module each (llm-compressor, ModelOpt), registered in
`BACKENDS` on import (base.py declares what a backend is). Backends import their library
inside the run function: importing this package stays cheap.
"""

import kiln.quant.backends.llmcompressor
import kiln.quant.backends.modelopt  # noqa: F401
from kiln.quant.backends.base import BACKENDS, Backend, QuantJob

__all__ = ["BACKENDS", "Backend", "QuantJob"]
