"""Writing what TensorRT-LLM reads: the unified checkpoint (and reading it back), and the
ModelOpt HF checkpoint its PyTorch backend loads.
"""
