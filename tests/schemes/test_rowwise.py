"""The fast quantization kernels against numpy division at every rounding boundary, across chunks, with few compiles."""

import ml_dtypes
import numpy as np
import pytest

import qconvert.schemes.rowwise as quantize_module
from qconvert.formats.errors import InvalidWeightError
from qconvert.write.tensors import all_finite
from qconvert.schemes.int8 import int8_codes_and_scales, quantize_int8
from qconvert.schemes.nf4 import nf4_codes_and_absmax, quantize_nf4

from quantize_reference import LEVELS, numpy_int8, numpy_nf4


def around(values: np.ndarray, steps: int = 2) -> np.ndarray:
    """Each float32 value with its `steps` neighbours on either side."""
    out = [values.astype(np.float32)]
    up = down = values.astype(np.float32)
    for _ in range(steps):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    return np.concatenate(out)


@pytest.mark.parametrize("seed", range(4))
def test_int8_matches_numpy_division_at_every_half_step(seed):
    # Rows hold (k + 0.5) * scale and its float32 neighbours for every k, for random scales:
    # exactly where a reciprocal multiply would round the other way.
    rng = np.random.default_rng(seed)
    rows = []
    for scale in rng.uniform(1e-4, 1e2, 6).astype(np.float32):
        halves = (np.arange(-127, 127, dtype=np.float32) + np.float32(0.5)) * scale
        row = around(halves)
        row[0] = np.float32(127) * scale  # pins the row's absmax, so its scale is `scale` itself
        rows.append(row)
    w = np.stack(rows)
    q = quantize_int8(w, scale_dtype=np.float32)
    q_ref, scale_ref = numpy_int8(w, np.float32)
    np.testing.assert_array_equal(np.asarray(q.scale), scale_ref)
    np.testing.assert_array_equal(np.asarray(q.qvalue), q_ref)


def test_nf4_matches_numpy_reciprocal_scaling_at_every_midpoint():
    rng = np.random.default_rng(3)
    mids = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)
    blocks = []
    for absmax in rng.uniform(1e-3, 1e3, 8).astype(np.float32):
        values = around(mids * absmax, steps=3)  # 105 values; split over two blocks, each pinned by absmax
        for part in (values[:63], values[63:]):
            block = np.zeros(64, np.float32)
            block[0], block[1:1 + part.size] = absmax, part
            blocks.append(block)
    w = np.stack(blocks)
    n = quantize_nf4(w)
    packed_ref, absmax_ref = numpy_nf4(w)
    np.testing.assert_array_equal(np.asarray(n.scale), absmax_ref)
    np.testing.assert_array_equal(np.asarray(n.qvalue), packed_ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [(37, 29), (64, 33), (1, 7), (9, 1)])
def test_chunk_tails_and_odd_sizes_match_numpy(monkeypatch, dtype, shape):
    # Tiny chunks, so every shape spans several chunks and ends in a padded tail.
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 256)
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 0.1).astype(dtype)
    q = quantize_int8(w)
    q_ref, scale_ref = numpy_int8(w, dtype)
    np.testing.assert_array_equal(np.asarray(q.qvalue), q_ref)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale_ref.astype(np.float32))
    n = quantize_nf4(w)
    packed_ref, absmax_ref = numpy_nf4(w)
    np.testing.assert_array_equal(np.asarray(n.qvalue), packed_ref)
    np.testing.assert_array_equal(np.asarray(n.scale), absmax_ref)


def test_many_tensor_shapes_compile_few_kernels(monkeypatch):
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 1 << 12)
    int8_codes_and_scales.clear_cache()
    nf4_codes_and_absmax.clear_cache()
    rng = np.random.default_rng(0)
    # Four row counts, two column counts: whole chunks of 64 (cols 64) or 32 (cols 128) rows.
    for rows in (64, 128, 192, 256):
        for cols in (64, 128):
            w = rng.standard_normal((rows, cols)).astype(np.float32)
            quantize_int8(w)
            quantize_nf4(w)
    assert int8_codes_and_scales._cache_size() == 2  # one per column count
    assert nf4_codes_and_absmax._cache_size() == 1  # every size is a whole number of 4096-value chunks


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_nf4])
def test_huge_finite_weights_are_not_taken_for_inf(quantize):
    # Their float32 sum overflows: the quick check doubts, the exact one clears them.
    w = np.full((4, 64), 3e38, np.float32)
    q = quantize(w)
    assert np.all(np.isfinite(np.asarray(q.scale)))
    assert all_finite(w) and not all_finite(np.where(np.eye(4, 64) > 0, np.nan, w).astype(np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_in_a_padded_tail_chunk_is_refused(monkeypatch, bad):
    monkeypatch.setattr(quantize_module, "CHUNK_ELEMENTS", 256)
    w = np.ones((11, 40), ml_dtypes.bfloat16)
    w[10, 39] = bad
    for quantize in (quantize_int8, quantize_nf4):
        with pytest.raises(InvalidWeightError, match="NaN or Inf"):
            quantize(w)


@pytest.mark.parametrize("index", [5, (1 << 20) + 3])
def test_the_float_tensor_check_sees_nan_in_whole_chunks_and_in_the_tail(index):
    from qconvert.write.tensors import all_finite as float_tensor_finite

    w = np.ones((1 << 20) + 7, ml_dtypes.bfloat16)
    assert float_tensor_finite(w)
    w[index] = np.nan
    assert not float_tensor_finite(w)
    assert not float_tensor_finite(np.where(np.arange(9) == 4, np.inf, 1.0))  # float64: numpy only
