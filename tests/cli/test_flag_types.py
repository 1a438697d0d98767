"""Every value from outside goes through the gate (qconvert.formats.outside) where it enters: each command's
parameters, a source folder's names, config values, tensor names, Hub addresses; and what the user sees of it
is one printable line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint, make_tokenizer
from qconvert.cli.flag_types import CHECKED_TYPES, FIXED_TYPES
from qconvert.cli.main import cli


def test_every_parameter_of_every_command_is_checked_where_it_enters():
    unchecked = [f"{name} {param.name}: {param.type!r}" for name, command in cli.commands.items()
                 for param in command.params if not isinstance(param.type, FIXED_TYPES + CHECKED_TYPES)]
    assert unchecked == []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("gate") / "model")
    make_tokenizer(folder, vocab_size=256)
    return folder


def _refused(argv, tmp_path, capsys, code):
    """Run `argv` with --json; assert the exit code, one printable stderr line, one JSON document naming the
    same error, and nothing written under tmp_path. Returns the line."""
    before = tree(tmp_path)
    exit_code, stdout, stderr = run([*argv, "--json"], capsys)
    assert exit_code == code, stderr
    assert stderr.endswith("\n") and stderr[:-1].isprintable(), repr(stderr)
    document = json.loads(stdout)
    assert document["exit_code"] == code and stderr == f"qconvert: error: {document['error']}\n"
    assert tree(tmp_path) == before
    return stderr


@pytest.mark.parametrize("flag", [["--group-size", "²"], ["--calib-samples", "١٢٨"], ["--gptq-damp", "nan"],
                                  ["--max-shard-size", "١٠GB"], ["--workers", "1e9"]])
def test_unicode_digits_and_nan_in_flags_are_usage_errors(model, tmp_path, capsys, flag):
    line = _refused(["quantize", str(model), "-o", str(tmp_path / "out"), "--scheme", "int4", *flag],
                    tmp_path, capsys, 2)
    assert flag[0] in line


@pytest.mark.parametrize("address", ["hf://datasets/a/b//etc/passwd", "hf://datasets/a/b/x/../../c.txt",
                                     "hf://datasets/a/b/./c.txt", "hf://datasets/ａ/b/c.txt"])
def test_a_hub_file_path_that_climbs_or_is_absolute_is_a_usage_error(model, tmp_path, capsys, address):
    line = _refused(["quantize", str(model), "-o", str(tmp_path / "out"), "--scheme", "w8a8", "--calib", address],
                    tmp_path, capsys, 2)
    assert "calibration address" in line


@pytest.mark.parametrize("flag", ["--include", "--exclude", "--revision", "--calib-column", "--alpha"])
def test_control_characters_in_a_flag_are_refused_and_never_printed(model, tmp_path, capsys, flag):
    line = _refused(["quantize", str(model), "-o", str(tmp_path / "out"), "--scheme", "w8a8", flag,
                     "x\x1b]0;owned\x07\n"], tmp_path, capsys, 2)
    assert "\x1b" not in line and "control character (\\x1b)" in line


def test_a_source_folder_whose_name_is_not_utf8_is_refused_before_anything_is_written(model, tmp_path, capsys):
    source = tmp_path / os.fsdecode(b"model-\xff")
    shutil.copytree(model, source)
    line = _refused(["quantize", str(source), "-o", str(tmp_path / "out")], tmp_path, capsys, 2)
    assert "not UTF-8" in line and "\\xff" in line


def test_a_parent_folder_whose_name_is_not_utf8_is_refused_too(model, tmp_path, capsys, monkeypatch):
    parent = tmp_path / os.fsdecode(b"\xfe-models")
    shutil.copytree(model, parent / "model")
    monkeypatch.chdir(parent)
    line = _refused(["quantize", "model", "-o", str(tmp_path / "out")], tmp_path, capsys, 2)
    assert "\\xfe" in line


def test_an_out_under_a_folder_whose_name_is_not_utf8_is_refused(model, tmp_path, capsys):
    bad = tmp_path / os.fsdecode(b"out-\xff")
    bad.mkdir()
    line = _refused(["quantize", str(model), "-o", str(bad / "q")], tmp_path, capsys, 2)
    assert "\\xff" in line


def test_a_nan_in_config_json_is_an_invalid_checkpoint(model, tmp_path, capsys):
    source = shutil.copytree(model, tmp_path / "nan-config")
    config = json.loads((source / "config.json").read_text())
    text = json.dumps({**config, "initializer_range": 0.02}).replace("0.02", "NaN")
    (source / "config.json").write_text(text)
    line = _refused(["quantize", str(source), "-o", str(tmp_path / "out")], tmp_path, capsys, 6)
    assert "config.json" in line and "NaN" in line


@pytest.mark.parametrize("bad_name", ["model.layers.0.mlp\n.weight", "model.\x1b[2Jnorm.weight", "lm\u202ehead"])
def test_a_tensor_name_with_control_characters_is_an_invalid_checkpoint(model, tmp_path, capsys, bad_name):
    source = shutil.copytree(model, tmp_path / "bad-names")
    save_file({bad_name: np.zeros(4, np.float32)}, str(source / "extra.safetensors"))
    index = source / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"][bad_name] = "extra.safetensors"
        index.write_text(json.dumps(data))
    line = _refused(["quantize", str(source), "-o", str(tmp_path / "out")], tmp_path, capsys, 6)
    assert "tensor name" in line and "\x1b" not in line


def test_forced_colour_never_redraws_bars_into_a_log(model, tmp_path):
    """FORCE_COLOR=1 with stderr to a file: plain progress lines, no cursor movement or line erasing."""
    log = tmp_path / "log.txt"
    with open(log, "w") as stderr:
        done = subprocess.run([sys.executable, "-m", "qconvert.cli.main", "quantize", str(model), "-o",
                               str(tmp_path / "out"), "--scheme", "w8a8", "--calib-samples", "2",
                               "--calib-seqlen", "8"], stderr=stderr, stdout=subprocess.DEVNULL,
                              env={**os.environ, "FORCE_COLOR": "1", "HF_HUB_OFFLINE": "1"}, timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text
    assert text and all(line.startswith("qconvert: ") for line in text.splitlines())
    assert "\x1b[" not in text and "\r" not in text


@pytest.mark.parametrize("variable, value, words", [
    ("HF_ENDPOINT", "notaurl", "HF_ENDPOINT 'notaurl' is not an http:// or https:// address"),
    ("HF_ENDPOINT", "http://hub\x1b[2J", "HF_ENDPOINT holds a control character (\\x1b)"),
    ("HF_HUB_ETAG_TIMEOUT", "abc", "HF_HUB_ETAG_TIMEOUT ('abc') is not a whole number"),
    ("HF_HUB_DOWNLOAD_TIMEOUT", "١٠", "HF_HUB_DOWNLOAD_TIMEOUT ('١٠') is not a whole number"),
])
def test_a_hub_variable_huggingface_hub_would_choke_on_is_exit_2_naming_it(model, tmp_path, capsys, monkeypatch,
                                                                           variable, value, words):
    monkeypatch.setenv(variable, value)
    line = _refused(["quantize", "someone/model", "-o", str(tmp_path / "out")], tmp_path, capsys, 2)
    assert words in line and line.endswith("; fix or unset it\n")
