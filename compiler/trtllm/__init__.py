"""TensorRT-LLM unified checkpoint: export from a quantised HF checkpoint, and read back.

`export_checkpoint(model_dir, out_dir, tp_size=..., dtype=...)` writes `config.json` and
`rank{N}.safetensors` for `trtllm-build` (TensorRT-LLM 1.2.x); `decode_checkpoint(dir)`
returns the float weights it carries, under Hugging Face names, for round-trip checks.
"""

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint

__all__ = ["decode_checkpoint", "export_checkpoint", "read_checkpoint"]
