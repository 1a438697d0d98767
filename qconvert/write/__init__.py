"""QArrays -> OUT: quantizing ahead of the writer (prefetch.py), the output folder staged beside OUT and
renamed into place (folder.py), and the model card (card.py). The shards themselves are written by
formats/safetensors_io.py, in the order convert.py's plan streams them."""
