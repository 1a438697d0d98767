"""config.json that disagrees with the weights is refused at plan time, before anything is written (exit 6)."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    # hidden 64, 4 heads of 16, 2 KV heads, 2 layers, vocab 256, two shards with an index.
    return make_llama_checkpoint(tmp_path_factory.mktemp("consistency") / "src", shards=2)


def _config(src, **changes):
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


def _edit_tensors(src, edit):
    """Apply edit(name, tensors) to every shard's tensors (tensors is that shard's dict)."""
    for path in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(path))
        edit(path, tensors)
        save_file(tensors, str(path), metadata={"format": "pt"})


def config_says_4_layers(src):
    _config(src, num_hidden_layers=4)


def config_says_1_layer(src):
    _config(src, num_hidden_layers=1)


def hidden_size_128_against_64_wide_weights(src):
    _config(src, hidden_size=128)


def heads_do_not_divide_hidden_size(src):
    _config(src, num_attention_heads=6, num_key_value_heads=2, head_dim=None)


def layers_is_a_string(src):
    _config(src, num_hidden_layers="two")


def vocab_256_against_128_rows(src):
    def edit(path, tensors):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = tensors[name][:128]
    _edit_tensors(src, edit)


def final_norm_missing(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _edit_tensors(src, lambda path, t: t.pop("model.norm.weight") if path.name == shard else None)


def q_proj_stored_32_by_128(src):
    def edit(path, tensors):
        name = "model.layers.1.self_attn.q_proj.weight"
        if name in tensors:
            tensors[name] = tensors[name].reshape(32, 128)
    _edit_tensors(src, edit)


def index_omits_a_tensor(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def tensor_in_two_shards(src):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    holder = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != holder)
    copy = load_file(str(src / holder))[name] * 2  # a different copy
    tensors = load_file(str(src / other))
    tensors[name] = copy
    save_file(tensors, str(src / other), metadata={"format": "pt"})


def unread_tensor_in_a_layer(src):
    def edit(path, tensors):
        if "model.layers.0.input_layernorm.weight" in tensors:
            tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    _edit_tensors(src, edit)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = index["weight_map"][
        "model.layers.0.input_layernorm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


CASES = [
    (config_says_4_layers, "config.json: num_hidden_layers is 4, but the weights hold 2 numbered blocks; the "
                           "config does not fit the weights"),
    (config_says_1_layer, "model.layers.1.input_layernorm.weight is in the weights but not read by the model "
                          "config.json describes (num_hidden_layers=1)"),
    (hidden_size_128_against_64_wide_weights, "model.embed_tokens.weight has shape [256, 64], but config.json "
                                              "implies [256, 128]"),
    (heads_do_not_divide_hidden_size, "config.json: num_attention_heads = 6 does not divide hidden_size = 64"),
    (layers_is_a_string, "config.json: num_hidden_layers is 'two'; it must be a whole number"),
    (vocab_256_against_128_rows, "model.embed_tokens.weight has shape [128, 64], but config.json implies [256, 64]"),
    (final_norm_missing, "model.norm.weight is missing from the weights"),
    (q_proj_stored_32_by_128, "model.layers.1.self_attn.q_proj.weight has shape [32, 128], but config.json "
                              "implies [64, 64]"),
    (index_omits_a_tensor, "omits tensor 'model.layers.0.mlp.up_proj.weight', which model-0000"),
    (tensor_in_two_shards, "tensor 'model.layers.0.mlp.up_proj.weight' is in both model-0000"),
    (unread_tensor_in_a_layer, "model.layers.0.self_attn.q_norm.weight is in the weights but not read"),
]


@pytest.mark.parametrize("break_it,words", CASES, ids=[c[0].__name__ for c in CASES])
def test_config_that_disagrees_with_the_weights_is_one_line_exit_6_and_nothing_written(pristine, tmp_path, capsys,
                                                                                        break_it, words):
    src = shutil.copytree(pristine, tmp_path / "src")
    break_it(src)
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 6, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconvert: error: ") and words in lines[0], lines
    assert tree(tmp_path) == before


@pytest.mark.parametrize("scheme_flags", [["--scheme", "nf4"], ["--scheme", "w8a8", "--calib", "random"],
                                          ["--scheme", "w8a8", "--no-smooth"]], ids=["nf4", "w8a8", "w8a8-plain"])
def test_every_scheme_checks_before_calibrating_or_writing(pristine, tmp_path, capsys, monkeypatch, scheme_flags):
    import qconvert.calibration.observer

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran on a config that does not fit the weights")

    monkeypatch.setattr(qconvert.calibration.observer, "iterate_layers", no_calibration)
    src = shutil.copytree(pristine, tmp_path / "src")
    config_says_1_layer(src)
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out"), *scheme_flags], capsys)
    assert exit_code == 6 and "model.layers.1." in stderr and len(stderr.strip().splitlines()) == 1
    assert tree(tmp_path) == before


def test_calibrate_checks_too(pristine, tmp_path, capsys):
    src = shutil.copytree(pristine, tmp_path / "src")
    hidden_size_128_against_64_wide_weights(src)
    exit_code, _, stderr = run(["calibrate", str(src), "-o", str(tmp_path / "stats.safetensors"),
                                "--calib", "random"], capsys)
    assert exit_code == 6 and "model.embed_tokens.weight has shape [256, 64]" in stderr
    assert not (tmp_path / "stats.safetensors").exists()


def test_rotary_inv_freq_buffers_are_tolerated(pristine, tmp_path, capsys):
    src = shutil.copytree(pristine, tmp_path / "src")
    inv_freq = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)

    def edit(path, tensors):
        if "model.layers.0.input_layernorm.weight" in tensors:
            tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    _edit_tensors(src, edit)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.rotary_emb.inv_freq"] = index["weight_map"][
        "model.layers.0.input_layernorm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    exit_code, _, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert exit_code == 0, stderr


def test_architectures_given_as_a_string_is_named_as_such(pristine, tmp_path, capsys):
    src = shutil.copytree(pristine, tmp_path / "src")
    _config(src, architectures="LlamaForCausalLM")
    exit_code, _, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 6 and "missing" not in stderr
    assert stderr.strip() == ('qconvert: error: config.json: "architectures" is \'LlamaForCausalLM\'; it must be '
                              'a list of names, e.g. ["LlamaForCausalLM"]')
