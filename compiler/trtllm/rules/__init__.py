"""What TensorRT-LLM accepts, stated as data: the quantisation x GPU support matrix per path
(support.py), the 1.2 checkpoint's exclusions (exclusions.py) and tensors (checkpoint.py),
the PyTorch backend's load rules (pytorch.py) and its serve options (serve_options.py).
"""
