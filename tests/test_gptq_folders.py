"""GPTQ folders end to end: NF4 rounded by GPTQ is still a bitsandbytes folder, qconvert.json says how each
folder was rounded, and the GPTQ flags refuse what does not fit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli
from hf_checkpoints import dequantized_float_folder, family_source, load_config, reference_logits, token_batch

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return family_source(tmp_path_factory.mktemp("llama"), "llama")


def quantize(source, out, capsys, *flags):
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "-q", *flags], capsys)
    assert code == 0, err
    return json.loads((out / "qconvert.json").read_text())


def test_nf4_gptq_folder_loads_in_bitsandbytes_as_its_own_dequantization(llama, tmp_path, capsys):
    import bitsandbytes
    import transformers

    out = tmp_path / "nf4"
    record = quantize(llama, out, capsys, "--scheme", "nf4", "--gptq", *CALIB)
    rounding = record["rounding"]
    assert rounding["method"] == "gptq" and rounding["damp"] == 0.01 and rounding["block_size"] == 128
    errors = rounding["modules"].values()
    assert len(errors) == 7 and all(e["error_gptq"] < e["error_rtn"] for e in errors)
    loaded_model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert isinstance(loaded_model.model.layers[0].mlp.down_proj, bitsandbytes.nn.Linear4bit)
    ids, mask = token_batch(load_config(llama)["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # transformers + bitsandbytes reading the folder
    meant = reference_logits(dequantized_float_folder(llama, out, tmp_path / "meant"), ids, mask)
    valid = mask.astype(bool)
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * np.abs(meant[valid]).max()


def test_round_to_nearest_is_recorded_and_gptq_changes_codes_not_scales(llama, tmp_path, capsys):
    from qconvert.formats.layouts import open_quantized

    rtn = quantize(llama, tmp_path / "rtn", capsys, "--scheme", "int8")
    gptq = quantize(llama, tmp_path / "gptq", capsys, "--scheme", "int8", "--gptq", "--gptq-act-order",
                    "--gptq-damp", "0.05", *CALIB)
    assert rtn["rounding"] == {"method": "rtn"}
    assert {k: gptq["rounding"][k] for k in ("method", "damp", "act_order")} == {
        "method": "gptq", "damp": 0.05, "act_order": True}
    a, b = open_quantized(tmp_path / "rtn"), open_quantized(tmp_path / "gptq")
    for module in a.quantized_modules:
        qa, qb = a.qarray(module), b.qarray(module)
        np.testing.assert_array_equal(np.asarray(qa.scale), np.asarray(qb.scale))
        assert np.mean(np.asarray(qa.qvalue) != np.asarray(qb.qvalue)) > 0.01


def test_two_gptq_runs_give_identical_bytes(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=64, intermediate=128)
    first = quantize(src, tmp_path / "a", capsys, "--scheme", "w8a8", *CALIB)
    second = quantize(src, tmp_path / "b", capsys, "--scheme", "w8a8", *CALIB)
    assert first["rounding"]["method"] == "gptq"
    assert first["files"] == second["files"]


@pytest.mark.parametrize("flags,message", [
    (["--scheme", "w8a8", "--gptq", "--act-stats", "stats.safetensors"], "--gptq needs calibration activations"),
    (["--scheme", "int8", "--gptq-damp", "0.1"], "apply with GPTQ only"),
    (["--scheme", "int4", "--gptq-damp", "0"], "--gptq-damp must be a fraction"),
    (["--scheme", "nf4", "--calib", "random"], "also with --gptq"),
    (["--scheme", "int4", "--alpha", "0.5"], "apply to --scheme w8a8 only"),
])
def test_gptq_flags_that_do_not_fit_are_usage_errors(tmp_path, capsys, flags, message):
    src = make_llama_checkpoint(tmp_path / "src")
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "out"), *flags], capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()
