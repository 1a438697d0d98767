"""--scheme fp8 against compressed-tensors itself: its FP8 quantization of the same weights, its FP8_DYNAMIC config."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams

import qconvert.schemes.rowwise as rowwise
from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli
from cli_helpers import tree
from qconvert.formats.layouts import open_quantized
from qconvert.schemes import scheme_named
from qconvert.schemes.fp8 import fp8_clip_search, quantize_fp8

TORCH_DTYPES = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float16): torch.float16,
                np.dtype(np.float32): torch.float32}
FP8_ARGS = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)


def compressed_tensors_fp8(w: np.ndarray):
    """compressed-tensors' own FP8 per channel: min/max per row, calculate_qparams, quantize to float8_e4m3fn."""
    t = torch.from_numpy(w.astype(np.float32)).to(TORCH_DTYPES[w.dtype])
    scale, zero_point = calculate_qparams(t.amin(dim=1, keepdim=True), t.amax(dim=1, keepdim=True), FP8_ARGS)
    codes = quantize(t, scale, zero_point, FP8_ARGS, dtype=torch.float8_e4m3fn)
    return codes, scale


def weight(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.02).astype(dtype)
    w[0] = 0  # an all-zero row: compressed-tensors puts its dtype's eps there
    w[3, 5] = 1.5  # an outlier: the rest of its row lands in E4M3's subnormals
    w[4, :7] = -0.0  # negative zeros: compressed-tensors' zero point makes them +0
    w[5, 9] = 1e-7  # rounds to zero
    return w


@pytest.mark.parametrize("shape, dtype", [
    ((576, 1536), ml_dtypes.bfloat16),
    ((64, 14336), ml_dtypes.bfloat16),  # a 4096 x 14336 down_proj's rows, fewer of them
    ((576, 1536), np.float16),
    ((576, 1536), np.float32),
])
def test_codes_and_scales_are_compressed_tensors_own_bytes(shape, dtype):
    w = weight(shape, dtype)
    codes, scale = compressed_tensors_fp8(w)
    q = quantize_fp8(w)
    assert np.asarray(q.qvalue).dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert np.asarray(q.scale).dtype == np.dtype(dtype) and np.shape(q.scale) == (shape[0], 1)
    np.testing.assert_array_equal(np.asarray(q.qvalue).view(np.uint8), codes.view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale.float().numpy())


def test_compressed_tensors_decompresses_the_folder_to_the_values_qconvert_means(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "fp8"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "fp8", "-q"], capsys)
    assert code == 0, err
    folder = open_quantized(out)
    q = folder.qarray("model.layers.0.mlp.down_proj")
    codes = torch.from_numpy(np.asarray(q.qvalue).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    theirs = dequantize(codes, torch.from_numpy(np.asarray(q.scale)), args=FP8_ARGS).float().numpy()
    np.testing.assert_array_equal(np.asarray(q.dequantize(np.float32)), theirs)
    np.testing.assert_array_equal(scheme_named("fp8").folder_weight(q).astype(np.float32), theirs)
    folder.close()


def test_the_quantization_config_is_the_compressed_tensors_fp8_dynamic_preset(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "fp8"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "fp8", "-q"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    preset = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    group = parsed.config_groups["group_0"]
    # Every field but the weights' observer, which names how the scales were found (min/max, as
    # llm-compressor records it in its folders), not how a loader reads them.
    assert group.weights.model_copy(update={"observer": None}) == preset.weights
    assert group.weights.observer == "minmax"
    assert group.input_activations == preset.input_activations
    assert group.targets == preset.targets and group.output_activations is None
    assert parsed.format == "float-quantized" and parsed.ignore == ["lm_head"]
    stored = open_quantized(out).checkpoint
    assert stored.dtype("model.layers.0.mlp.down_proj.weight") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert stored.shape("model.layers.0.mlp.down_proj.weight_scale") == (128, 1)
    assert not any(n.endswith((".input_scale", ".weight_zero_point")) for n in stored.tensor_names)


def test_streamed_rows_give_the_whole_tensor_quantization(monkeypatch):
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 3_000)
    w = weight((37, 576), ml_dtypes.bfloat16, seed=1)
    scheme = scheme_named("fp8")
    flags = scheme.layout_flags(shapes={"m": w.shape})
    streamed = scheme.quantize_rows(lambda a, b: w[a:b], w.shape, w.dtype, flags)
    whole = quantize_fp8(w)
    np.testing.assert_array_equal(np.asarray(streamed.qvalue).view(np.uint8), np.asarray(whole.qvalue).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(streamed.scale), np.asarray(whole.scale))


def test_clip_search_never_does_worse_than_the_plain_scale():
    rng = np.random.default_rng(2)
    w = rng.standard_t(2, (64, 512)).astype(np.float32)  # heavy tails: small values reach the subnormals
    found = fp8_clip_search(w)
    assert found.ratios.shape == (64,) and found.ratios.max() == 1.0
    assert found.error_searched <= found.error_plain


def test_act_static_is_refused_in_one_line(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src")
    before = tree(tmp_path)
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "fp8", "--act", "static"],
                           capsys)
    assert code == 2
    assert err.strip() == ("qconvert: error: --scheme fp8 quantizes activations per token at run time; --act "
                           "static (a calibrated per-tensor scale) is not written for it: drop --act static")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("magnitude", [0.02, 3e-3, 1e-4, 1e-6])
def test_float16_rows_with_subnormal_scales_are_compressed_tensors_own_bytes(magnitude):
    """float16 rows with absmax below about 0.027 have a subnormal scale (absmax / 448): kept, as
    compressed-tensors keeps it (it was flushed to zero, and the codes and scales differed)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((32, 512)) * 0.02).astype(np.float16)
    w[:8] = (rng.standard_normal((8, 512)) * magnitude).astype(np.float16)
    codes, scale = compressed_tensors_fp8(w)
    q = quantize_fp8(w)
    np.testing.assert_array_equal(np.asarray(q.qvalue).view(np.uint8), codes.view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale.float().numpy())
