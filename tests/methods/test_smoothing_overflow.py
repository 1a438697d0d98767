"""Smoothing that takes a float16 weight past float16's range is qconvert's doing, not the checkpoint's: one
line naming the tensor, the dtype and what to do, exit 2, nothing left beside OUT."""

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import run
from safetensors.numpy import load_file, save_file

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]


@pytest.fixture(scope="module")
def float16_model(tmp_path_factory):
    # One huge norm gain makes its channel's activations ~1e5; alpha 1 moves all of that into q/k/v's column.
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("fp16") / "model", dtype="float16")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.input_layernorm.weight"][0] = np.float16(30000)
    tensors["model.layers.0.self_attn.q_proj.weight"][:, 0] = np.float16(1.0)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("extra", [[], ["--gptq"]], ids=["rtn", "gptq"])
def test_a_smoothing_overflow_names_the_tensor_and_the_remedy(float16_model, tmp_path, capsys, extra):
    out = tmp_path / "out"
    code, stdout, stderr = run(["quantize", str(float16_model), "-o", str(out), "--scheme", "w8a8", "--alpha", "1",
                                "-q", *CALIB, *extra], capsys)
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith(
        "qconvert: error: model.layers.0.self_attn.q_proj.weight: SmoothQuant's scales (--alpha) make it ")
    assert "beyond float16's largest 65504; give a smaller --alpha" in stderr
    assert list(tmp_path.iterdir()) == []


def test_the_same_checkpoint_converts_where_nothing_is_smoothed_that_far(float16_model, tmp_path, capsys):
    for scheme, extra in (("int8", []), ("w8a8", ["--alpha", "0.5", *CALIB])):
        code, _, stderr = run(["quantize", str(float16_model), "-o", str(tmp_path / scheme), "--scheme", scheme,
                               "-q", *extra], capsys)
        assert code == 0, stderr
