"""config.json values that would give NaN or runaway work are refused before anything runs: one line naming
the key, exit 6, nothing written."""

import json
import shutil

import pytest

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint
from qconvert.formats.errors import InvalidCheckpointError


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("bad-config") / "model")


def _edited(source, root, edit):
    folder = root / "model"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


W8A8 = ["--scheme", "w8a8", "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "8"]


@pytest.mark.parametrize("edit,message", [
    ({"rope_theta": 0}, "config.json: rope_theta is 0; it must be a positive number"),
    ({"rope_theta": -10000.0}, "config.json: rope_theta is -10000.0; it must be a positive number"),
    ({"rope_theta": "10000"}, "config.json: rope_theta is '10000'; it must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}},
     "config.json: rope_scaling.factor is 0; it must be a positive number"),
    ({"rope_scaling": {"type": "linear", "factor": "2"}},
     "config.json: rope_scaling.factor is '2'; it must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 0.0}},
     "config.json: rope_scaling.rope_theta is 0.0; it must be a positive number"),
    ({"rope_scaling": "linear"}, "config.json: rope_scaling is 'linear'; it must be an object"),
    ({"rope_scaling": {"rope_type": 3}}, "config.json: rope_scaling.rope_type is 3; it must be a string"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}},
     "config.json: rope_scaling.high_freq_factor = 4.0 is not above low_freq_factor = 4.0; the llama3 RoPE "
     "scaling needs high > low"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": "64"}},
     "config.json: rope_scaling.original_max_position_embeddings is '64'; it must be a whole number of at "
     "least 1"),
    ({"num_hidden_layers": 10**12},
     "config.json: num_hidden_layers is 1000000000000, but the weights hold 2 numbered blocks; the config does "
     "not fit the weights"),
], ids=["theta-0", "theta-negative", "theta-string", "linear-factor-0", "factor-string", "scaling-theta-0",
        "scaling-not-object", "type-not-string", "llama3-high-not-above-low", "llama3-original-string",
        "10^12-layers"])
@pytest.mark.parametrize("scheme", [[], W8A8], ids=["int8", "w8a8"])
def test_a_bad_config_value_is_one_line_exit_6_before_anything_runs(llama, tmp_path, capsys, edit, message,
                                                                    scheme):
    folder = _edited(llama, tmp_path, edit)
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "-q", *scheme],
                                    capsys)
    assert (exit_code, stdout, stderr) == (6, "", f"qconvert: error: {message}\n")
    assert tree(tmp_path) == before


def test_calibrate_refuses_a_config_claiming_10_to_the_12_layers(llama, tmp_path, capsys):
    folder = _edited(llama, tmp_path, {"num_hidden_layers": 10**12})
    before = tree(tmp_path)
    exit_code, _, stderr = run(["calibrate", str(folder), "-o", str(tmp_path / "stats.safetensors"), "--calib",
                                "random"], capsys)
    assert (exit_code, stderr) == (6, "qconvert: error: config.json: num_hidden_layers is 1000000000000, but the "
                                      "weights hold 2 numbered blocks; the config does not fit the weights\n")
    assert tree(tmp_path) == before


def test_gemma3_local_rope_base_of_0_is_named(tmp_path, capsys):
    from gemma_checkpoints import GEMMA3, make_gemma_checkpoint

    fields = {k: v for k, v in GEMMA3.items() if k != "rope_parameters"}
    folder = make_gemma_checkpoint(tmp_path / "gemma", fields)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=1_000_000.0, rope_local_base_freq=0)
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # transformers' own progress bar while saving
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert (exit_code, stderr) == (6, "qconvert: error: config.json: rope_local_base_freq is 0; it must be a "
                                      "positive number\n")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("value", [1e308, 2**31, 10**30])
def test_a_count_past_any_checkpoint_is_refused_before_anything_sizes_by_it(value):
    from qconvert.models.config_values import config_int

    with pytest.raises(InvalidCheckpointError, match="num_hidden_layers .* at most 2147483647"):
        config_int({"num_hidden_layers": value}, "num_hidden_layers")
