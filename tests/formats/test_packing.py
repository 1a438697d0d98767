"""Bit packing and double quantization agree with hand-worked cases, independent code and the peer libraries."""

import bitsandbytes.functional as bnb_functional
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qconvert.formats.packing import (
    dequantize_blockwise,
    dequantize_double_quant,
    double_quantize_absmax,
    pack_int8_to_int32,
    pack_nf4_codes,
    quantize_blockwise,
    signed_dynamic_map,
    torch_float32_sum,
    unpack_int32_to_int8,
    unpack_nf4_bytes,
)
from qconvert.formats.qarray import unpack_nf4_codes


def reference_pack_int8(q: np.ndarray) -> np.ndarray:
    """Word by word from the FORMATS.md rule, with Python integers."""
    rows, cols = q.shape
    words = (cols + 3) // 4
    out = np.zeros((rows, words), dtype=np.int64)
    for r in range(rows):
        for k in range(words):
            word = 0
            for j in range(4):
                c = 4 * k + j
                if c < cols:
                    word |= (int(q[r, c]) + 128) << (8 * j)
            out[r, k] = word - (1 << 32) if word >= 1 << 31 else word
    return out.astype(np.int32)


int8_matrices = st.tuples(st.integers(1, 4), st.integers(1, 13)).flatmap(
    lambda shape: arrays(np.int8, shape, elements=st.integers(-128, 127))
)


@settings(max_examples=25, deadline=None)
@given(int8_matrices)
def test_int8_packing_matches_the_rule_and_compressed_tensors(q):
    packed = pack_int8_to_int32(q)
    np.testing.assert_array_equal(packed, reference_pack_int8(q))
    np.testing.assert_array_equal(packed, pack_to_int32(torch.from_numpy(q), 8).numpy())
    np.testing.assert_array_equal(unpack_int32_to_int8(packed, q.shape[1]), q)
    peer = unpack_from_int32(torch.from_numpy(packed), 8, torch.Size(q.shape)).numpy()
    np.testing.assert_array_equal(peer, q)


def test_int8_packing_hand_worked_case():
    q = np.array([[-128, -1, 0, 127, 5]], dtype=np.int8)
    # u = 0, 127, 128, 255 -> 0xFF807F00; u = 133 then three zero bytes -> 0x85.
    np.testing.assert_array_equal(pack_int8_to_int32(q), np.array([[np.int32(-0x007F8100), 0x85]], dtype=np.int32))


def test_int8_packing_rejects_wrong_inputs():
    with pytest.raises(ValueError):
        pack_int8_to_int32(np.zeros((2, 3), np.int16))
    with pytest.raises(ValueError):
        unpack_int32_to_int8(np.zeros((2, 2), np.int32), 9)


def test_nf4_packing_hand_worked_case():
    np.testing.assert_array_equal(pack_nf4_codes(np.array([1, 2, 3, 15, 0])), np.array([0x12, 0x3F, 0x07], np.uint8))
    np.testing.assert_array_equal(pack_nf4_codes(np.array([[15, 14], [0, 9]])), np.array([0xFE, 0x09], np.uint8))


@settings(max_examples=12, deadline=None)
@given(arrays(np.uint8, st.integers(1, 41), elements=st.integers(0, 15)))
def test_nf4_packing_round_trips_through_both_unpackers(codes):
    packed = pack_nf4_codes(codes)
    assert packed.shape == ((codes.size + 1) // 2,)
    expected = [(int(codes[2 * k]) << 4) | (int(codes[2 * k + 1]) if 2 * k + 1 < codes.size else 7)
                for k in range(packed.size)]
    assert packed.tolist() == expected
    np.testing.assert_array_equal(unpack_nf4_bytes(packed, codes.size), codes)
    np.testing.assert_array_equal(np.asarray(unpack_nf4_codes(packed, codes.size)), codes)


def test_nf4_packing_rejects_codes_out_of_range():
    with pytest.raises(ValueError):
        pack_nf4_codes(np.array([16]))


def test_signed_dynamic_map_equals_bitsandbytes_bit_for_bit():
    ours = signed_dynamic_map()
    theirs = bnb_functional.create_dynamic_map(signed=True).numpy()
    assert ours.dtype == np.float32 and ours.shape == (256,)
    assert ours.tobytes() == theirs.tobytes()


def bnb_blockwise(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes' own CPU blockwise quantizer with its default (signed dynamic) map."""
    indices, state = bnb_functional.quantize_blockwise(torch.from_numpy(np.asarray(values, np.float32)),
                                                       blocksize=block_size)
    return indices.numpy(), state.absmax.numpy()


def blockwise_values(n: int, seed: int) -> np.ndarray:
    """Normal values with an all-zero block, a huge value and values on the map's midpoints (scaled by 1)."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(n).astype(np.float32) * 3
    values[256:512] = 0.0
    values[n // 3] = 3e30
    code = signed_dynamic_map()
    midpoints = np.float32(0.5) * (code[:-1] + code[1:])
    tail = np.concatenate([[np.float32(1.0)], midpoints, np.nextafter(midpoints, np.float32(2.0))])
    return np.concatenate([values, tail.astype(np.float32)])


@pytest.mark.parametrize("n", [1, 255, 256, 700, 5000])
def test_blockwise_quantization_equals_bitsandbytes_byte_for_byte(n):
    values = blockwise_values(n, seed=n)
    indices, absmax = quantize_blockwise(values, signed_dynamic_map(), 256)
    theirs, their_absmax = bnb_blockwise(values, 256)
    assert indices.tobytes() == theirs.tobytes() and absmax.tobytes() == their_absmax.tobytes()
    decoded = dequantize_blockwise(indices, absmax, signed_dynamic_map(), 256)
    np.testing.assert_array_equal(decoded, bnb_functional.dequantize_blockwise(
        torch.from_numpy(theirs), absmax=torch.from_numpy(their_absmax), blocksize=256).numpy())


def test_blockwise_takes_the_table_point_nearest_the_value_and_zero_blocks_index_0():
    # Worked by hand from the rule: point k = -1 + 2k/65535; k = trunc((x + 1) / 2 * 65535 + 0.5).
    # -0.5 lies on the midpoint of -1 and 0; its point k = 16384 is -0.4999924, above the midpoint: entry 0.0.
    code = np.array([-1.0, 0.0, 0.5, 1.0], dtype=np.float32)
    indices, absmax = quantize_blockwise(np.array([1.0, 0.25, 0.75, -0.5], np.float32), code, 4)
    assert indices.tolist() == [3, 1, 2, 1] and absmax.tolist() == [1.0]
    indices, absmax = quantize_blockwise(np.zeros(3, np.float32), code, 4)
    assert indices.tolist() == [0, 0, 0] and absmax.tolist() == [0.0]


def test_float32_sum_follows_torch_order():
    rng = np.random.default_rng(4)
    for n in [1, 3, 7, 8, 9, 63, 64, 65, 1000, 4096, 20000, 32767]:
        values = rng.uniform(0, 1, n).astype(np.float32) * np.float32(rng.uniform(0.01, 100))
        theirs = with_one_thread(lambda values=values: torch.from_numpy(values).sum().numpy())
        assert torch_float32_sum(values).tobytes() == theirs.tobytes(), n


def with_one_thread(call):
    """Run `call` with torch on one thread: from 32768 values on, torch splits a sum between its threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return call()
    finally:
        torch.set_num_threads(threads)


def bnb_nested_state(weight: np.ndarray):
    return with_one_thread(lambda: bnb_functional.quantize_4bit(
        torch.from_numpy(weight), blocksize=64, compress_statistics=True, quant_type="nf4")[1])


@pytest.mark.parametrize("shape", [(160, 129), (8, 64), (1536, 384), (2048, 1040)])
def test_double_quantization_equals_bitsandbytes_byte_for_byte(shape):
    weight = np.random.default_rng(shape[0]).standard_normal(shape).astype(np.float32) * 0.02
    weight[1] = 0.0
    weight[2, 3] = 1e4
    state = bnb_nested_state(weight)
    absmax = np.abs(np.concatenate([weight.reshape(-1), np.zeros(-weight.size % 64, np.float32)])
                    ).reshape(-1, 64).max(axis=1)
    codes, nested_absmax, offset = double_quantize_absmax(absmax)
    assert codes.tobytes() == state.absmax.numpy().tobytes()
    assert nested_absmax.tobytes() == state.state2.absmax.numpy().tobytes()
    assert offset.tobytes() == state.offset.numpy().astype(np.float32).tobytes()
    assert signed_dynamic_map().tobytes() == state.state2.code.numpy().tobytes()
    # Decoding bitsandbytes' own double-quantized state gives what bitsandbytes gives.
    theirs = bnb_functional.dequantize_blockwise(state.absmax, state.state2).numpy() + state.offset.numpy()
    ours = dequantize_double_quant(codes, nested_absmax, offset, state.state2.code.numpy())
    np.testing.assert_array_equal(ours, theirs)


def test_double_quantization_error_is_small_and_formula_holds():
    absmax = np.random.default_rng(3).uniform(0.5, 2.0, 600).astype(np.float32)
    codes, nested_absmax, offset = double_quantize_absmax(absmax)
    code = bnb_functional.create_dynamic_map(signed=True).numpy()
    by_formula = np.array(
        [code[codes[j]] * nested_absmax[j // 256] + offset for j in range(absmax.size)], dtype=np.float32
    )
    decoded = dequantize_double_quant(codes, nested_absmax, offset)
    np.testing.assert_array_equal(decoded, by_formula)
    # 8-bit dynamic codes on values within [-1, 1] of the block max: well under 1% of the range.
    assert np.abs(decoded - absmax).max() < 0.01 * np.abs(absmax - offset).max()
