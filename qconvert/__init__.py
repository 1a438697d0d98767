"""qconvert: quantize Hugging Face checkpoints and verify the result."""

__version__ = "0.1.0"
