"""Published pre-quantised checkpoints (AutoAWQ, AutoGPTQ, GPTQModel): detect what one holds
and convert it to compressed-tensors without recalibrating.
"""
