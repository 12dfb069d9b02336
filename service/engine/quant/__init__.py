"""Quantized weights: the modes and their checks (quantization), the 8-bit linear layer of the W8A8 modes and of
weight-only int8 on CUDA (w8a8), and its Triton kernels (triton_w8a8)."""
