"""int8 and NF4 quantization against independent numpy computations of the FORMATS.md rules."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qconvert.formats.errors import InvalidWeightError
from qconvert.formats.qarray import NF4_LEVELS
from qconvert.schemes.int8 import quantize_int8
from qconvert.schemes.nf4 import quantize_nf4

from quantize_reference import LEVELS, numpy_int8, numpy_nf4


def looped_nf4(w: np.ndarray, block=64):
    """The NF4 rules element by element, walking up the levels (scaled as numpy_nf4 says bitsandbytes does)."""
    flat = w.astype(np.float32).ravel()
    n = flat.size
    codes = np.empty(n, np.uint8)
    absmax = np.empty(-(-n // block), np.float32)
    for b in range(absmax.size):
        x = flat[b * block:(b + 1) * block]
        absmax[b] = np.abs(x).max()
        if x.size < block:
            absmax[b] = max(absmax[b], np.float32(1e-38))
            norm = x / absmax[b]
        else:
            norm = x * (np.float32(1) / absmax[b]) if absmax[b] > 0 else np.zeros_like(x)
        for i, v in enumerate(norm):
            # Walk up the levels: move to the next one only if v is strictly past the midpoint.
            c = 0
            while c < 15 and v > (LEVELS[c] + LEVELS[c + 1]) / np.float32(2):
                c += 1
            codes[b * block + i] = c
    if n % 2:
        codes = np.append(codes, 7)
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed.astype(np.uint8), absmax


def test_code_table_is_the_formats_table():
    np.testing.assert_array_equal(NF4_LEVELS, LEVELS)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_int8_codes_and_scales_equal_numpy(dtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((24, 40)) * 0.05).astype(dtype)
    w[3] = 0  # an all-zero row must not divide by zero
    q = quantize_int8(w)
    q_ref, scale_ref = numpy_int8(w, dtype)
    np.testing.assert_array_equal(np.asarray(q.qvalue), q_ref)
    assert np.asarray(q.scale).dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale_ref.astype(np.float32))
    assert q.shape == (24, 40) and q.kind == "int8"


def test_int8_rounds_half_to_even_hand_worked():
    # absmax 127 -> scale exactly 1.0; 2.5 -> 2, 3.5 -> 4, -0.5 -> 0.
    w = np.array([[127.0, 2.5, 3.5, -0.5, -127.0]], np.float32)
    q = quantize_int8(w)
    np.testing.assert_array_equal(np.asarray(q.qvalue), [[127, 2, 4, 0, -127]])
    np.testing.assert_array_equal(np.asarray(q.scale), [[1.0]])


@settings(max_examples=8, deadline=None)
@given(out=st.integers(1, 9), inp=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int8_dequantized_within_half_a_step(out, inp, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) * rng.uniform(1e-3, 10)).astype(np.float32)
    q = quantize_int8(w, scale_dtype=np.float32)
    err = np.abs(np.asarray(q.dequantize(np.float32)) - w)
    assert np.all(err <= np.asarray(q.scale) / 2 * (1 + 1e-5))


@pytest.mark.parametrize("shape", [(8, 64), (3, 50), (5, 13), (1, 1)])
def test_nf4_packed_bytes_and_absmax_equal_independent_rules(shape):
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape).astype(np.float32)
    q = quantize_nf4(w)
    packed_ref, absmax_ref = looped_nf4(w)
    np.testing.assert_array_equal(np.asarray(q.qvalue), packed_ref)
    np.testing.assert_array_equal(np.asarray(q.scale), absmax_ref)
    # The vectorized reference the convert tests use agrees with the looped one.
    np.testing.assert_array_equal(numpy_nf4(w)[0], packed_ref)
    assert q.block_size == 64 and q.shape == shape and q.kind == "nf4"


def test_nf4_midpoint_ties_go_to_the_lower_code():
    mids = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)
    # One block: absmax 1.0 (the last value), every midpoint exactly, then zeros.
    w = np.zeros(64, np.float32)
    w[:15] = mids
    w[15] = 1.0
    q = quantize_nf4(w.reshape(1, 64))
    codes = np.stack([np.asarray(q.qvalue) >> 4, np.asarray(q.qvalue) & 15], -1).ravel()
    np.testing.assert_array_equal(codes[:15], np.arange(15))
    assert codes[15] == 15 and np.all(codes[16:] == 7)


def test_nf4_zero_block_is_all_level_zero():
    q = quantize_nf4(np.zeros((2, 64), np.float32))
    np.testing.assert_array_equal(np.asarray(q.qvalue), np.full(64, 0x77, np.uint8))
    np.testing.assert_array_equal(np.asarray(q.dequantize(np.float32)), np.zeros((2, 64)))


@settings(max_examples=8, deadline=None)
@given(out=st.integers(1, 6), inp=st.integers(1, 150), seed=st.integers(0, 2**16))
def test_nf4_dequantized_within_half_the_widest_level_gap(out, inp, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, inp)).astype(np.float32)
    q = quantize_nf4(w)
    absmax = np.repeat(np.asarray(q.scale), 64)[: w.size].reshape(w.shape)
    err = np.abs(np.asarray(q.dequantize(np.float32)) - w)
    widest_gap = np.max(np.diff(LEVELS))
    assert np.all(err <= absmax * widest_gap / 2 * (1 + 1e-5))


def test_large_matrices_match_numpy_division_exactly():
    # Enough values that a reciprocal-multiply shortcut would flip some roundings.
    rng = np.random.default_rng(7)
    w = rng.standard_normal((1024, 384)).astype(np.float32)
    q = quantize_int8(w)
    q_ref, scale_ref = numpy_int8(w, np.float32)
    np.testing.assert_array_equal(np.asarray(q.scale), scale_ref)
    np.testing.assert_array_equal(np.asarray(q.qvalue), q_ref)
    n = quantize_nf4(w)
    packed_ref, absmax_ref = numpy_nf4(w)
    np.testing.assert_array_equal(np.asarray(n.qvalue), packed_ref)
    np.testing.assert_array_equal(np.asarray(n.scale), absmax_ref)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("quantize", [quantize_int8, quantize_nf4])
def test_nan_or_inf_anywhere_is_refused(bad, quantize):
    for index in (3, 128 * 64 - 1):
        w = np.ones((128, 64), np.float32)
        w.reshape(-1)[index] = bad
        with pytest.raises(InvalidWeightError, match="NaN or Inf"):
            quantize(w)


@pytest.mark.parametrize("shape", [(160, 129), (5, 77), (96, 200)])
def test_nf4_packed_bytes_and_absmax_equal_bitsandbytes(shape):
    import bitsandbytes.functional as bnb_functional
    import torch

    rng = np.random.default_rng(shape[1])
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w[1] = 0.0
    w[2, 3] = 1e4
    w.reshape(-1)[-(w.size % 64 or 64):] = 0.0  # an all-zero last block (partial where the size is not whole blocks)
    mids = (LEVELS[:-1] + LEVELS[1:]) / np.float32(2)
    w.reshape(-1)[64:64 + mids.size] = mids * np.float32(0.03)  # values on the thresholds of a block
    w.reshape(-1)[64 + mids.size] = np.float32(0.03)
    packed, state = bnb_functional.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4")
    q = quantize_nf4(w)
    assert np.asarray(q.qvalue).tobytes() == packed.numpy().tobytes()
    assert np.asarray(q.scale).tobytes() == state.absmax.numpy().tobytes()
