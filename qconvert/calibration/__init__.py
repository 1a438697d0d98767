"""Text -> per-layer statistics: the calibration text and its tokens (documents.py, tokenizer.py, data.py), the
float model run a layer at a time with its linears' inputs observed (observer.py), and the memory it may take
(memory.py)."""
