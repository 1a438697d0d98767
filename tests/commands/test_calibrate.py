"""`qconvert calibrate` and the w8a8 flags of `qconvert quantize`, through the console entry point; and the
calibration inputs every command that calibrates refuses with one line and its exit code."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer
from cli_helpers import run as run_cli, tree

from qconvert.cli.main import main
from qconvert.formats.layouts import open_quantized

RANDOM = ["--calib", "random"]
QCONVERT = str(Path(sys.executable).parent / "qconvert")


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
    (["--scheme", "int8", "--shard-experts", "never"], "--shard-experts also with --gptq, --awq or --kv-cache"),
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


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("small") / "src")


@pytest.fixture
def llama(tmp_path):
    return make_llama_checkpoint(tmp_path / "src", dtype="bfloat16")


def test_calibrate_refuses_zero_samples(source, tmp_path, capsys):
    exit_code, _, stderr = run_cli(["calibrate", str(source), "-o", str(tmp_path / "s.safetensors"),
                                    "--calib-samples", "0"], capsys)
    assert exit_code == 2 and "--calib-samples" in stderr and list(tmp_path.iterdir()) == []


def test_a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_where_the_ids_are_made(tmp_path, capsys):
    """The embedding's gather filled NaN for such ids: w8a8 chose alpha 0 everywhere and GPTQ fell back to
    rounding, exit 0. Refused for every command that tokenizes (quantize's calibration, calibrate, verify's
    evaluation text all read it through one function)."""
    from checkpoints import make_tokenizer

    folder = make_llama_checkpoint(tmp_path / "src", vocab=64)
    make_tokenizer(folder, vocab_size=512)
    before = tree(tmp_path)
    for args in (["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8"],
                 ["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "int4"],
                 ["calibrate", str(folder), "-o", str(tmp_path / "stats.safetensors")]):
        code, _, err = run_cli(args, capsys)
        assert code == 6, (args, err)
        (line,) = err.strip().splitlines()[-1:]
        assert "tokenizer.json gives token id " in line and "outside config.json's vocab_size 64" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("text, messages", [
    ("hello", ["gives 1 token(s) of text; calibrating needs at least 16"]),
    ("\ufeff" + "\x00" * 200, ["token(s) of text; calibrating needs at least 16", "holds no word"]),
    ("... ; , !! ?? " * 40, ["holds no word"]),
])
def test_calibration_text_that_fits_nothing_is_refused(tmp_path, capsys, text, messages):
    """One token (or only a BOM and NULs) was accepted: --act static fitted every scale on two tokens, exit 0."""
    from checkpoints import make_tokenizer

    folder = make_llama_checkpoint(tmp_path / "src")
    make_tokenizer(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text(text, encoding="utf-8")
    before = tree(tmp_path)
    code, _, err = run_cli(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "w8a8", "--act", "static",
                            "--calib", str(calib)], capsys)
    assert code == 2, err
    (line,) = err.strip().splitlines()[-1:]
    assert any(message in line for message in messages), line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_calibrating_on_verifys_held_out_text_is_refused(llama, tmp_path, capsys, command):
    """quantize --calib held-out calibrated on verify's evaluation text and recorded it as never calibrated on."""
    out = tmp_path / ("out" if command == "quantize" else "stats.safetensors")
    args = ["--scheme", "w8a8"] if command == "quantize" else []
    before = tree(tmp_path)
    code, _, err = run_cli([command, str(llama), "-o", str(out), *args, "--calib", "held-out"], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("qconvert: error: --calib held-out is verify's evaluation text")
    assert tree(tmp_path) == before


def test_a_calibration_that_cannot_fit_this_machine_is_refused_before_any_window(llama, tmp_path, capsys):
    """--calib-samples 1e9 (and verify --samples 1e9) were exit 70 (MemoryError making the windows), 20000 on a
    tiny model std::bad_alloc or the OOM killer: refused, exit 2, naming the estimate, before any work."""
    huge = "1000000000"
    out = tmp_path / "out"
    assert run_cli(["quantize", str(llama), "-o", str(out), "-q"], capsys)[0] == 0
    before = tree(tmp_path)
    for args, flag in ((["quantize", str(llama), "-o", str(tmp_path / "o2"), "--scheme", "int4", "--calib-samples",
                         huge], "--calib-samples"),
                       (["quantize", str(llama), "-o", str(tmp_path / "o2"), "--scheme", "w8a8", "--calib", "random",
                         "--calib-samples", huge], "--calib-samples"),
                       (["calibrate", str(llama), "-o", str(tmp_path / "s.safetensors"), "--calib-samples", huge],
                        "--calib-samples"),
                       (["verify", str(out), "--backend", "xla", "--samples", huge], "--samples")):
        code, _, err = run_cli(args, capsys)
        assert code == 2, (args, err)
        (line,) = err.strip().splitlines()[-1:]
        assert f"on 1,000,000,000 x " in line and "GiB of this machine's memory even one window at a time" in line
        assert f"fewer {flag}" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("scheme", ["w8a8", "int4"])
def test_nan_activations_stop_calibration_where_they_appear(tmp_path, capsys, scheme):
    """A NaN weight inside a layer made every statistic after it NaN: w8a8 chose alpha 0 everywhere and GPTQ fell
    back to rounding, before the writer's own NaN check. The statistics are checked where they are made."""
    from safetensors.numpy import load_file, save_file

    folder = make_llama_checkpoint(tmp_path / "src")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, folder / "model.safetensors")
    before = tree(tmp_path)
    code, _, err = run_cli(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", scheme, *RANDOM], capsys)
    assert code == 7, err
    (line,) = err.strip().splitlines()[-1:]
    assert line == ("qconvert: error: calibration: the input of model.layers.0.mlp.down_proj holds NaN or Inf: the "
                    "float model overflows there, or a weight before it is not finite; fix the checkpoint")
    assert tree(tmp_path) == before


def test_an_unreachable_hub_for_calibration_text_is_one_line_within_seconds(model, tmp_path):
    # A model that can tokenize the text (its tokenizer is checked before the text is fetched).
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    done = subprocess.run([QCONVERT, "calibrate", str(model), "-o", str(tmp_path / "stats.safetensors"),
                           "--calib", "hf://datasets/some-org/texts/train.txt"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 4 and time.monotonic() - started < 10
    assert len(done.stderr.splitlines()) == 1 and "hf://datasets/some-org/texts/train.txt" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
