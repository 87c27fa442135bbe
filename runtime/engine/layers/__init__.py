"""The model's linear layers, one module per weight format, and the exact greedy LM head;
`kernels.make_linear` picks one per layer.
"""
