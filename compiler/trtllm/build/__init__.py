"""TensorRT-LLM 1.2.x engine builds: the `trtllm-build` plan and its pre-checks, the builder
host, and the stamp that ties an engine to its GPU and TensorRT version.
"""
