"""Scale searches against brute-force numpy over the same grids, and --scale-search end to end."""

import json

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from quantize_reference import LEVELS
from safetensors.numpy import load_file

from qconvert.convert import ConvertOptions, convert
from qconvert.schemes.int8 import INT8_CLIP_GRID, OUTPUT_ERROR_ROWS, int8_clip_search, quantize_int8
from qconvert.schemes.nf4 import NF4_CLIP_GRID, NF4_THRESHOLDS, nf4_clip_search, quantize_nf4
from qconvert.methods.scale_search import STATIC_RATIO_GRID, static_scale_search


def heavy_tailed(shape, seed):
    """Weights with a few large entries per row, as trained layers have."""
    return (np.random.default_rng(seed).standard_t(3, shape) * 0.02).astype(np.float32)


def numpy_int8_rows(w, c):
    """Per row: scale = c * absmax / 127, q = rint(w / scale) clamped; the dequantized rows (float64)."""
    absmax = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True)
    scale = np.maximum(c * absmax / 127, 1e-12)
    return np.clip(np.rint(w / scale), -127, 127) * scale


def numpy_nf4_blocks(blocks, c):
    """Blocks quantized to NF4 with stored absmax c * max|block|; values beyond clip to +-1."""
    absmax = c * np.abs(blocks).max(axis=1, keepdims=True)
    norm = blocks / np.where(absmax == 0, 1, absmax)
    midpoints = (LEVELS[:-1].astype(np.float64) + LEVELS[1:]) / 2
    codes = (norm[..., None] > midpoints).sum(-1)
    return LEVELS[codes].astype(np.float64) * absmax


def grid_index(grid, ratios):
    """Where each chosen ratio sits on the grid."""
    return np.argmin(np.abs(np.asarray(grid)[:, None] - np.asarray(ratios, np.float64)[None, :]), axis=0)


def test_int8_weight_error_search_takes_each_rows_least_error_ratio():
    w = heavy_tailed((40, 96), 0)
    found = int8_clip_search(w)
    errors = np.stack([((w - numpy_int8_rows(w, c)) ** 2).sum(1) for c in INT8_CLIP_GRID])
    chosen = errors[grid_index(INT8_CLIP_GRID, found.ratios), np.arange(40)]
    np.testing.assert_allclose(chosen, errors.min(0), rtol=1e-4)
    assert found.error_plain == pytest.approx(errors[0].sum(), rel=1e-4)
    assert found.error_searched <= found.error_plain


def test_int8_output_error_search_weighs_rows_by_the_activations():
    w = heavy_tailed((32, 64), 1)
    x = np.random.default_rng(2).standard_normal((OUTPUT_ERROR_ROWS, 64)).astype(np.float32)  # all rows used
    x[:, 5] *= 30  # an outlier channel: errors in column 5 cost 30x more
    found = int8_clip_search(w, x)
    errors = np.stack([((x.astype(np.float64) @ (w - numpy_int8_rows(w, c)).T) ** 2).sum(0)
                       for c in INT8_CLIP_GRID])
    chosen = errors[grid_index(INT8_CLIP_GRID, found.ratios), np.arange(32)]
    np.testing.assert_allclose(chosen, errors.min(0), rtol=1e-3)
    assert found.error_searched < 0.95 * found.error_plain, (found.error_searched, found.error_plain)


def test_quantize_int8_with_clip_ratios_follows_the_rule():
    w = heavy_tailed((24, 50), 3)
    ratios = np.linspace(0.7, 1.0, 24).astype(np.float32)
    q = quantize_int8(w, scale_dtype=np.float32, clip=ratios)
    absmax = np.abs(w).max(axis=1) * ratios
    scale = (absmax / np.float32(127)).astype(np.float32)[:, None]
    np.testing.assert_array_equal(np.asarray(q.scale), scale)
    np.testing.assert_array_equal(np.asarray(q.qvalue), np.clip(np.rint(w / scale), -127, 127).astype(np.int8))


def test_nf4_block_search_and_clipped_quantization_follow_the_rule():
    w = heavy_tailed((16, 200), 4)  # 3200 values: 50 blocks
    found = nf4_clip_search(w.reshape(-1), 64, LEVELS, NF4_THRESHOLDS)
    blocks = w.reshape(-1, 64).astype(np.float64)
    errors = np.stack([((blocks - numpy_nf4_blocks(blocks, c)) ** 2).sum(1) for c in NF4_CLIP_GRID])
    chosen = errors[grid_index(NF4_CLIP_GRID, found.ratios), np.arange(50)]
    np.testing.assert_allclose(chosen, errors.min(0), rtol=1e-4)
    assert found.error_searched < 0.97 * found.error_plain
    q = quantize_nf4(w, clip=found.ratios)
    np.testing.assert_array_equal(np.asarray(q.scale), (np.abs(w.reshape(-1, 64)).max(1) * found.ratios))
    np.testing.assert_allclose(np.asarray(q.dequantize(np.float32)).reshape(-1, 64),
                               numpy_nf4_blocks(blocks, found.ratios[:, None].astype(np.float64)), rtol=1e-6,
                               atol=1e-9)


def test_static_scale_search_beats_the_max_when_one_activation_is_massive():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2048, 48)).astype(np.float32)
    x[7, 3] = 100.0  # one massive activation in one token sets the max for all
    w = rng.standard_normal((20, 48)).astype(np.float32) * 0.1
    w_q = numpy_int8_rows(w, 1.0).astype(np.float32)
    absmax = float(np.abs(x).max())
    scale, found = static_scale_search(x, w, w_q, absmax)
    y = x.astype(np.float64) @ w.T.astype(np.float64)
    errors = [(((np.clip(np.rint(x / np.float32(r * absmax / 127)), -127, 127) * np.float32(r * absmax / 127))
                @ w_q.T.astype(np.float64) - y) ** 2).sum() for r in STATIC_RATIO_GRID]
    assert found.error_searched == pytest.approx(min(errors), rel=1e-3)
    assert found.error_plain == pytest.approx(errors[0], rel=1e-3)
    assert scale < absmax / 127 and found.error_searched < 0.9 * found.error_plain


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("search") / "src", hidden=64, intermediate=160,
                                 vocab=64, seed=6)


def test_nf4_scale_search_is_recorded_lowers_weight_error_and_bitsandbytes_reads_it(llama, tmp_path):
    import torch
    from bitsandbytes.functional import QuantState, dequantize_4bit

    convert(str(llama), tmp_path / "plain", ConvertOptions(scheme="nf4"))
    convert(str(llama), tmp_path / "searched", ConvertOptions(scheme="nf4", scale_search=True))
    manifest = json.loads((tmp_path / "searched" / "qconvert.json").read_text())
    assert manifest["flags"]["scale_search"] is True
    assert json.loads((tmp_path / "plain" / "qconvert.json").read_text())["scale_search"] is None
    records = manifest["scale_search"]["modules"]
    src = load_file(str(llama / "model.safetensors"))
    for name, folder in (("plain", tmp_path / "plain"), ("searched", tmp_path / "searched")):
        stored = load_file(str(folder / "model.safetensors"))
        m = "model.layers.0.mlp.up_proj"
        w = src[f"{m}.weight"]
        state = QuantState(absmax=torch.from_numpy(stored[f"{m}.weight.absmax"]), shape=torch.Size(w.shape),
                           code=torch.from_numpy(stored[f"{m}.weight.quant_map"]), blocksize=64,
                           quant_type="nf4", dtype=torch.float32)
        deq = dequantize_4bit(torch.from_numpy(stored[f"{m}.weight"]), state).numpy()
        error = float(((deq.astype(np.float64) - w) ** 2).sum())
        if name == "plain":
            plain_error = error
        else:
            assert error < 0.98 * plain_error
            assert error == pytest.approx(records[m]["weight_clip"]["error_searched"], rel=1e-3)
            assert plain_error == pytest.approx(records[m]["weight_clip"]["error_plain"], rel=1e-3)


def test_int8_scale_search_is_opt_in_and_deterministic(llama, tmp_path):
    convert(str(llama), tmp_path / "a", ConvertOptions(scheme="int8", scale_search=True))
    convert(str(llama), tmp_path / "b", ConvertOptions(scheme="int8", scale_search=True))
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    record = json.loads((tmp_path / "a" / "qconvert.json").read_text())["scale_search"]
    assert record["weight_clip"]["grid"][0] == 1.0
    for r in record["modules"].values():
        assert r["weight_clip"]["objective"] == "weight error"
        assert r["weight_clip"]["error_searched"] <= r["weight_clip"]["error_plain"]
