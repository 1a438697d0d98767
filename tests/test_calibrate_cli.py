"""`qconvert calibrate` and the w8a8 flags of `qconvert quantize`, through the console entry point."""

import json

import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer

from qconvert.cli.main import main
from qconvert.formats.layouts import open_quantized


def run(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("m") / "model", outlier_channels=(2,))
    make_tokenizer(folder, vocab_size=256)
    return folder


def test_calibrate_then_quantize_with_act_stats(model, tmp_path, capsys):
    stats = tmp_path / "stats.safetensors"
    assert run(["calibrate", str(model), "-o", str(stats), "--calib-samples", "3", "--calib-seqlen", "16",
                "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["linears"] == 15  # 14 block linears and lm_head
    assert summary["calibration"]["source"] == "builtin" and summary["calibration"]["tokens"] == 48

    out = tmp_path / "out"
    assert run(["quantize", str(model), "-o", str(out), "--scheme", "w8a8", "--act", "static",
                "--act-stats", str(stats), "--alpha", "0.5", "-q"]) == 0
    manifest = json.loads((out / "qconvert.json").read_text())
    assert manifest["calibration"]["description"] == "qconvert's built-in English prose corpus"
    assert manifest["calibration"]["stats_file"]["name"] == "stats.safetensors"
    assert set(manifest["smoothing"]["alpha"].values()) == {0.5}
    q = open_quantized(out)
    assert all(q.input_scale(m) > 0 for m in q.quantized_modules)


def test_calibrate_writes_the_same_bytes_every_run(model, tmp_path):
    """The statistics file is byte-reproducible (its metadata in a fixed order) and a plain safetensors file."""
    from safetensors import safe_open

    paths = [tmp_path / f"stats{i}.safetensors" for i in range(2)]
    for path in paths:
        assert run(["calibrate", str(model), "-o", str(path), "--calib", "random", "--calib-samples", "2",
                    "--calib-seqlen", "8"]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    with safe_open(str(paths[0]), framework="numpy") as f:
        assert f.metadata()["format"] == "qconvert-act-stats" and f.metadata()["tokens"] == "16"
        absmax = f.get_tensor("model.layers.0.mlp.down_proj.act_absmax")
        assert absmax.dtype.name == "float32" and absmax.shape == (128,)
        assert f.get_tensor("model.layers.0.mlp.down_proj.act_tensor_absmax")[0] == absmax.max()


def test_alpha_auto_records_the_search(model, tmp_path):
    out = tmp_path / "auto"
    assert run(["quantize", str(model), "-o", str(out), "--scheme", "w8a8", "--alpha", "auto",
                "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16", "-q"]) == 0
    smoothing = json.loads((out / "qconvert.json").read_text())["smoothing"]
    assert smoothing["alpha_mode"] == "auto"
    for source, errors in smoothing["alpha_search"].items():
        assert len(errors) == 21
        chosen = smoothing["alpha"][source]
        assert errors[f"{chosen:.2f}"] == min(errors.values())
    # the planted outlier channel (x50) pulls the choice well away from alpha = 0
    assert smoothing["alpha"]["model.layers.0.input_layernorm"] >= 0.2


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "int8", "--alpha", "0.5"], "apply to --scheme w8a8 only"),
    (["--scheme", "w8a8", "--no-smooth", "--alpha", "0.5"], "--alpha has no effect with --no-smooth"),
    (["--scheme", "w8a8", "--alpha", "1.5"], "outside [0, 1]"),
    (["--scheme", "w8a8", "--alpha", "nope=0.5"], "matches no smoothing group"),
    (["--scheme", "w8a8", "--calib", "missing.txt"], "does not exist"),
    (["--scheme", "w8a8", "--act-stats", "missing.safetensors"], "does not exist"),
    (["--scheme", "w8a8", "--act-stats", "s.safetensors", "--calib", "random"], "drop --calib"),
    (["--scheme", "w8a8", "--act-stats", "s.safetensors", "--shard-experts", "always"], "drop --shard-experts"),
    (["--scheme", "int8", "--shard-experts", "never"], "--shard-experts also with --gptq or --awq"),
    (["--scheme", "w8a8", "--shard-experts", "sometimes"], "'sometimes' is not one of"),
])
def test_bad_calibration_flags_exit_2_with_one_line(model, tmp_path, capsys, argv, message):
    assert run(["quantize", str(model), "-o", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_calibrate_in_a_pipe_prints_each_progress_line_once(tmp_path, capsys):
    """The head's statistics repeated the last layer's progress line."""
    from checkpoints import make_llama_checkpoint
    from cli_helpers import run

    folder = make_llama_checkpoint(tmp_path / "src")
    code, _, err = run(["calibrate", str(folder), "-o", str(tmp_path / "s.safetensors"), "--calib", "random",
                        "--calib-samples", "4", "--calib-seqlen", "16"], capsys)
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("qconvert: calibrating: ")]
    assert len(lines) == 1 and lines[0].startswith("qconvert: calibrating: 2/2 layers")
