"""A folder holding both model.safetensors and the shards of an index (what a sharded save leaves over a one-file
model): transformers loads model.safetensors, so converting the shards would convert other weights than the
model people load. Refused (exit 6, one line) by every command that reads the folder, nothing written."""

from __future__ import annotations

from safetensors.numpy import load_file, save_file

from checkpoints import make_llama_checkpoint
from cli_helpers import run, tree


def two_sets(folder):
    make_llama_checkpoint(folder, shards=2)
    tensors = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        tensors.update(load_file(shard))
    save_file({k: (v * 2).astype(v.dtype) for k, v in tensors.items()}, folder / "model.safetensors")
    return folder


def test_quantize_and_calibrate_refuse_two_sets_of_weights(tmp_path, capsys):
    folder = two_sets(tmp_path / "src")
    before = tree(tmp_path)
    for args in (["quantize", str(folder), "-o", str(tmp_path / "out")],
                 ["calibrate", str(folder), "-o", str(tmp_path / "stats.safetensors"), "--calib", "random"]):
        code, _, err = run(args, capsys)
        assert code == 6, (args, err)
        (line,) = err.strip().splitlines()
        assert "holds model.safetensors beside the shards model.safetensors.index.json lists" in line
        assert "transformers loads model.safetensors" in line
    assert tree(tmp_path) == before


def test_an_index_that_lists_model_safetensors_itself_is_one_set(tmp_path, capsys):
    folder = tmp_path / "src"
    make_llama_checkpoint(folder)  # model.safetensors
    names = list(load_file(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {' + ", ".join(f'"{n}": "model.safetensors"' for n in names) + "}}")
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert code == 0, err
