"""Text -> per-layer statistics: the calibration text and its tokens (data.py, tokenizer.py), the float
model run a layer at a time with its linears' inputs observed (observer.py), and the memory it may take
(memory.py)."""
