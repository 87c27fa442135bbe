"""What the HTTP layer serves from: kiln's own engine (native) or a TensorRT-LLM engine
(trtllm), behind one Backend protocol.
"""
