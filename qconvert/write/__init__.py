"""QArrays -> OUT: the tensor stream (tensors.py), quantizing ahead of the writer (prefetch.py), the output
folder staged and renamed into place (folder.py), and the model card (card.py)."""
