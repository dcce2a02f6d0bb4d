"""Kernels: the native C kernels for the CPU (compiled at first use for this CPU) and the Triton ops of the GPU
path."""
