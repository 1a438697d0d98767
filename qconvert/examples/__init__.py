"""Small models to try qconvert on offline: a byte-level Llama trained on the built-in text (llama.py)."""
