"""qconvert verify: quantized kernels against float references, per layer and per model."""
