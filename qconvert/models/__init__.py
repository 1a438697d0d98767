"""Supported architectures: which tensors are linears, how they are smoothed, a JAX forward."""
