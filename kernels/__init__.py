"""Quantized matmul kernels (Pallas, TPU and GPU), their pure-jnp references, and dispatch."""
