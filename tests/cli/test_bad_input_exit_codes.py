"""Bad input is one line and the exit code of its kind, never exit 70: patterns, calibration text and
addresses, a tokenizer that cannot encode, a JAX_PLATFORMS the host cannot start."""

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint, make_tokenizer

CALIB = ["--scheme", "w8a8", "--calib-samples", "2", "--calib-seqlen", "8", "-q"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("bad-input") / "model")
    make_tokenizer(folder, vocab_size=256)
    return folder


def _quantize(model, tmp_path, capsys, *argv):
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(model), "-o", str(tmp_path / "out"), *argv], capsys)
    assert tree(tmp_path) == before
    return exit_code, stdout, stderr


@pytest.mark.parametrize("flag,pattern,reason", [
    ("--include", "re:([", "unterminated character set at position 1"),
    ("--exclude", "re:*proj", "nothing to repeat at position 0"),
])
def test_an_invalid_regular_expression_is_exit_2(model, tmp_path, capsys, flag, pattern, reason):
    assert _quantize(model, tmp_path, capsys, flag, pattern) == (
        2, "", f"qconvert: error: {flag} {pattern} is not a valid regular expression ({reason}); fix the pattern\n")


@pytest.mark.parametrize("suffix,body", [(".txt", b"plain words \xff\xfe more words\n"),
                                         (".jsonl", b'{"text": "caf\xe9"}\n')])
def test_calibration_text_that_is_not_utf8_is_exit_2(model, tmp_path, capsys, suffix, body):
    text = tmp_path / f"calib{suffix}"
    text.write_bytes(body)
    start = body.index(b"\xff" if b"\xff" in body else b"\xe9")
    byte = body[start:start + 1]
    assert _quantize(model, tmp_path, capsys, *CALIB, "--calib", str(text)) == (
        2, "", f"qconvert: error: calibration file {text} is not UTF-8 text (byte {start}: {byte!r}); convert it "
               "to UTF-8\n")


@pytest.mark.parametrize("address", ["hf://datasets/../..", "hf://datasets/../../x.txt",
                                     "hf://datasets/a/../../x.txt", "hf://datasets/owner/name/../../etc/passwd"])
def test_a_dataset_address_that_climbs_out_is_exit_2(model, tmp_path, capsys, address, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _quantize(model, tmp_path, capsys, *CALIB, "--calib", address) == (
        2, "", f"qconvert: error: cannot read calibration address {address!r}; write "
               "hf://datasets/<owner>/<name>[@revision] (a whole dataset) or "
               "hf://datasets/<owner>/<name>[@revision]/<file.txt|file.jsonl>\n")


def test_a_tokenizer_that_loads_but_cannot_encode_is_exit_6(model, tmp_path, capsys):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["unk_token"] = "<not-in-the-vocabulary>"  # loads; fails on the first unknown word
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    exit_code, stdout, stderr = _quantize(folder, tmp_path, capsys, *CALIB)
    assert (exit_code, stdout) == (6, "")
    assert stderr.startswith(f"qconvert: error: {folder / 'tokenizer.json'} loads but cannot encode the "
                             "calibration text (Exception: ")
    assert stderr.endswith("); fix the tokenizer, or pass '--calib random'\n") and stderr.count("\n") == 1


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("command", [["quantize"], ["quantize", *CALIB, "--calib", "random"], ["calibrate"]],
                         ids=["int8", "w8a8", "calibrate"])
def test_a_jax_platform_the_host_cannot_start_is_exit_2(model, tmp_path, platform, command):
    # JAX starts its backends once per process: a child process sees the setting fresh.
    pytest.importorskip("jax")
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the host has an accelerator")
    before = tree(tmp_path)
    out = tmp_path / ("stats.safetensors" if command[0] == "calibrate" else "out")
    argv = [command[0], str(model), "-o", str(out), *command[1:]]
    result = subprocess.run([sys.executable, "-m", "qconvert.cli.main", *argv], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": platform}, timeout=300)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"qconvert: error: JAX_PLATFORMS={platform} names a platform JAX cannot start on "
                             "this host; unset JAX_PLATFORMS to let JAX choose, or set JAX_PLATFORMS=cpu\n")
    assert tree(tmp_path) == before
