"""TensorRT-LLM: the GPU targets and what runs on them (targets.py, rules/), the capacity
plan, the checkpoints kiln writes for it (export/), the 1.2 engine build (build/), the
PyTorch backend's serve options, and deploy.py, which puts one target into an artifact.
"""
