"""An FP8 source whose scale tensor holds NaN or inf: the scale is named, not the weight it scales, and numpy says
nothing (the scales are checked where they are read, before any product)."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import run, tree
from fp8_checkpoints import as_torch, write_fp8_source
from hf_checkpoints import make_hf_checkpoint

SCALED = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny bf16 Qwen3 in DeepSeek-style block FP8 (float32 and e8m0 scales) and compressed-tensors FP8_BLOCK."""
    root = tmp_path_factory.mktemp("fp8")
    bf16 = make_hf_checkpoint(root / "bf16", "qwen3", hidden=200, intermediate=160, layers=1, dtype="bfloat16")
    return {"deepseek": write_fp8_source(bf16, root / "deepseek"),
            "ue8m0": write_fp8_source(bf16, root / "ue8m0", scale_dtype="float8_e8m0fnu", ue8m0=True),
            "compressed": write_fp8_source(bf16, root / "compressed", style="compressed")}


def _with_scale(source, dst, style: str, value: float):
    """A copy of `source` with one scale of SCALED's weight set to `value` (e8m0: its NaN code 0xFF)."""
    shutil.copytree(source, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    name = SCALED + (".weight_scale" if style == "compressed" else ".weight_scale_inv")
    scale = tensors[name].clone()
    if style == "ue8m0":
        raw = scale.view(torch.uint8).numpy().copy()
        raw[0, 1] = 0xFF  # e8m0 has no infinity; its one non-finite code is NaN
        scale = as_torch(raw, torch.float8_e8m0fnu)
    else:
        scale[0, 1] = value
    tensors[name] = scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, name


@pytest.mark.parametrize("style, value, kind, args", [
    ("deepseek", float("nan"), "NaN", ["--scheme", "int8"]),
    ("deepseek", float("inf"), "infinite", ["--scheme", "int8"]),
    ("deepseek", float("-inf"), "infinite", ["--scheme", "w8a8", "--calib", "random", "--calib-samples", "2",
                                             "--calib-seqlen", "16"]),
    ("ue8m0", float("nan"), "NaN", ["--scheme", "int8"]),
    ("compressed", float("inf"), "infinite", ["--scheme", "int8"]),
    ("compressed", float("nan"), "NaN", ["--scheme", "nf4"]),
])
def test_a_scale_that_is_not_finite_is_named_exit_6_and_no_warning(sources, tmp_path, capsys, style, value, kind,
                                                                      args):
    source, scale_name = _with_scale(sources[style], tmp_path / "model", style, value)
    out = tmp_path / "out"
    before = tree(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, stdout, stderr = run(["quantize", str(source), "-o", str(out), "--json", *args], capsys)
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert code == 6
    line = (f"{source / 'model.safetensors'}: {scale_name} holds scales that are not finite ({kind}), so the fp8 "
            "weight they scale cannot be read; the checkpoint is corrupt")
    assert stderr == f"qconvert: error: {line}\n"
    document = json.loads(stdout)
    assert (document["exit_code"], document["error"], document["command"]) == (6, line, "quantize")
    assert tree(tmp_path) == before  # the source as it was, no OUT, no temporary beside it

