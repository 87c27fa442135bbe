"""What TensorRT-LLM accepts, stated as data: the quantisation x GPU support matrix per path,
the 1.2 checkpoint conformance rules and the PyTorch backend's load rules.
"""
