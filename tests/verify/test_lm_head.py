"""verify proves what quantize writes with a quantized lm_head and with a tied checkpoint that also stores
lm_head; `--act static` refuses, before calibrating, an included linear it can give no input scale."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cli_helpers import run, tree
from checkpoints import make_bert_checkpoint, make_llama_checkpoint, make_mixtral_checkpoint

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]
# Static scales must cover ids they were not fitted on (verify evaluates on another seed): on 4 x 16 calibration
# ids the worst layer's SQNR is 14.7 dB on verify's ids (29.7 dB on its own), on 16 x 32 it is 23.8 dB.
STATIC_CALIB = ["--calib", "random", "--calib-samples", "16", "--calib-seqlen", "32"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("lm-head") / "model")


def _verify(out, capsys):
    exit_code, stdout, stderr = run(["verify", str(out), "--quick", "--json", "-"], capsys)
    return exit_code, json.loads(stdout)


@pytest.mark.parametrize("scheme", [["--scheme", "int8"], ["--scheme", "nf4"], ["--scheme", "w8a8", *CALIB],
                                    ["--scheme", "w8a8", "--act", "static", *STATIC_CALIB]],
                         ids=["int8", "nf4", "w8a8", "w8a8-static"])
def test_verify_passes_a_folder_with_a_quantized_lm_head(llama, tmp_path, capsys, scheme):
    out = tmp_path / "out"
    assert run(["quantize", str(llama), "-o", str(out), "--include", "lm_head", "-q", *scheme], capsys)[0] == 0
    exit_code, report = _verify(out, capsys)
    assert exit_code == 0, report
    lm_head = [layer for layer in report["layers"] if layer["name"] == "lm_head"]
    assert len(lm_head) == 1 and lm_head[0]["passed"]
    assert report["integrity"]["problems"] == []


def test_verify_passes_qconverts_own_output_of_a_tied_checkpoint_that_stores_lm_head(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "tied", tie=True)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # tied, and stored anyway
    save_file(tensors, str(src / "model.safetensors"))
    out = tmp_path / "out"
    assert run(["quantize", str(src), "-o", str(out), "-q"], capsys)[0] == 0
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    exit_code, report = _verify(out, capsys)
    assert exit_code == 0 and report["integrity"]["problems"] == [], report


def test_static_activations_refuse_an_included_linear_outside_the_blocks_before_calibrating(tmp_path, capsys,
                                                                                          monkeypatch):
    import qconvert.methods.loop

    def refused(*args, **kwargs):
        raise AssertionError("calibrated before the combination was checked")

    monkeypatch.setattr(qconvert.methods.loop, "iter_layer_stats", refused)
    src = make_bert_checkpoint(tmp_path / "bert")
    tensors = load_file(str(src / "model.safetensors"))
    hidden = tensors["embeddings.LayerNorm.weight"].shape[0]
    tensors["pooler.dense.weight"] = np.eye(hidden, dtype=np.float32)  # as all-MiniLM-L6-v2 has it
    tensors["pooler.dense.bias"] = np.zeros(hidden, np.float32)
    save_file(tensors, str(src / "model.safetensors"))
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                                     "--act", "static", "--include", "pooler.dense", "-q", *CALIB], capsys)
    assert (exit_code, stdout, stderr) == (
        2, "", ("qconvert: error: --act static writes input scales only for the block linears and lm_head; "
                "pooler.dense (from --include) is neither: leave it out of --include, or use --act dynamic\n"))
    assert tree(tmp_path) == before


def test_static_activations_refuse_an_included_router_before_calibrating(tmp_path, capsys, monkeypatch):
    import qconvert.methods.loop

    def refused(*args, **kwargs):
        raise AssertionError("calibrated before the combination was checked")

    monkeypatch.setattr(qconvert.methods.loop, "iter_layer_stats", refused)
    src = make_mixtral_checkpoint(tmp_path / "mixtral")
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(src), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                                     "--act", "static", "--include", "model.layers.0.block_sparse_moe.gate",
                                     # experts are refused with static activations on their own (test_schemes.py)
                                     "--exclude", "*.experts.*", "-q",
                                     *CALIB], capsys)
    # Routers stay float whatever the activation mode: the selection refuses it first.
    assert (exit_code, stdout, stderr) == (
        2, "", ("qconvert: error: --include model.layers.0.block_sparse_moe.gate matches only routers or Conv1D "
                "linears (model.layers.0.block_sparse_moe.gate), which stay float: no loader reads them back "
                "quantized; leave it out of --include\n"))
    assert tree(tmp_path) == before
