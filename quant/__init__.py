"""Quantisation: the registry of methods and schemes, calibration data, backends
(llm-compressor, ModelOpt), pre-quantised checkpoint import, and the per-layer report.

`quantize.quantize()` is the one entry point the compiler's quantise stage calls: float
Hugging Face checkpoint in, quantised Hugging Face checkpoint out.
"""
