"""QArrays -> OUT: the output tensors, produced and streamed ahead of the shard writer (tensors.py, prefetch.py),
OUT written (output.py: the shards by formats/safetensors_writer.py, config.json, the side files of side_files.py,
the model card of card.py, qconvert.json naming the inputs of inputs.py), in a folder staged beside OUT and renamed
into place (folder.py, temporaries.py)."""
