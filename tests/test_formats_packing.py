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
    np.testing.assert_array_equal(pack_nf4_codes(np.array([1, 2, 3, 15, 0])), np.array([0x12, 0x3F, 0x00], np.uint8))
    np.testing.assert_array_equal(pack_nf4_codes(np.array([[15, 14], [0, 9]])), np.array([0xFE, 0x09], np.uint8))


@settings(max_examples=12, deadline=None)
@given(arrays(np.uint8, st.integers(1, 41), elements=st.integers(0, 15)))
def test_nf4_packing_round_trips_through_both_unpackers(codes):
    packed = pack_nf4_codes(codes)
    assert packed.shape == ((codes.size + 1) // 2,)
    expected = [(int(codes[2 * k]) << 4) | (int(codes[2 * k + 1]) if 2 * k + 1 < codes.size else 0)
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


def bnb_exact_blockwise(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes' own CPU blockwise quantizer on its exact argmin-nearest path.

    Its native float32 kernel searches the map approximately; handing the op a
    float64 tensor selects the path that takes the true nearest map entry.
    """
    code = bnb_functional.create_dynamic_map(signed=True)
    indices, absmax = torch.ops.bitsandbytes.quantize_blockwise(torch.from_numpy(values).double(), code, block_size)
    return indices.numpy(), absmax.numpy()


def assert_never_farther(values, absmax, ours, theirs, code, block_size):
    """Where the native kernel picks another entry, ours is at least as near to the scaled value."""
    scaled = values / np.repeat(absmax, block_size)[: values.size]
    assert np.all(np.abs(code[ours] - scaled) <= np.abs(code[theirs] - scaled))


@pytest.mark.parametrize("n", [1, 255, 256, 700])
def test_blockwise_quantization_equals_bitsandbytes(n):
    values = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 3
    code = signed_dynamic_map()
    indices, absmax = quantize_blockwise(values, code, 256)
    exact_indices, exact_absmax = bnb_exact_blockwise(values, 256)
    np.testing.assert_array_equal(indices, exact_indices)
    np.testing.assert_array_equal(absmax, exact_absmax)
    native, state = bnb_functional.quantize_blockwise(torch.from_numpy(values), blocksize=256)
    np.testing.assert_array_equal(absmax, state.absmax.numpy())
    assert np.mean(indices == native.numpy()) > 0.98
    assert_never_farther(values, absmax, indices, native.numpy(), code, 256)
    decoded = dequantize_blockwise(native.numpy(), absmax, code, 256)
    np.testing.assert_array_equal(decoded, bnb_functional.dequantize_blockwise(native, state).numpy())


def test_blockwise_ties_go_to_the_lower_code_and_zero_blocks_to_zero():
    code = np.array([-1.0, 0.0, 0.5, 1.0], dtype=np.float32)
    indices, absmax = quantize_blockwise(np.array([1.0, 0.25, 0.75, -0.5], np.float32), code, 4)
    assert indices.tolist() == [3, 1, 2, 0] and absmax.tolist() == [1.0]
    indices, absmax = quantize_blockwise(np.zeros(3, np.float32), code, 4)
    assert indices.tolist() == [1, 1, 1] and absmax.tolist() == [0.0]


def nf4_absmax_and_bnb_state(shape, seed):
    weight = torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
    _, plain = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=False, quant_type="nf4")
    _, nested = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    return plain.absmax.numpy(), nested


@pytest.mark.parametrize("shape", [(160, 129), (8, 64)])
def test_double_quantization_equals_bitsandbytes(shape):
    absmax, state = nf4_absmax_and_bnb_state(shape, seed=shape[0])
    codes, nested_absmax, offset = double_quantize_absmax(absmax)
    exact_mean = absmax.astype(np.float64).mean()
    assert offset == np.float32(exact_mean)
    # bitsandbytes sums in float32, so its offset may differ from the exact mean by an ulp.
    assert abs(float(offset) - state.offset.item()) <= 2 * np.spacing(np.float32(exact_mean))
    # Given bitsandbytes' offset, the codes are its exact-nearest codes and the nested absmax is its own.
    centred = absmax - np.float32(state.offset.item())
    codes_at_their_offset, nested_at_their_offset = quantize_blockwise(centred, signed_dynamic_map(), 256)
    np.testing.assert_array_equal(codes_at_their_offset, bnb_exact_blockwise(centred, 256)[0])
    np.testing.assert_array_equal(nested_at_their_offset, state.state2.absmax.numpy())
    assert_never_farther(centred, nested_at_their_offset, codes_at_their_offset, state.absmax.numpy(),
                         signed_dynamic_map(), 256)
    assert codes.dtype == np.uint8 and codes.shape == absmax.shape
    assert nested_absmax.shape == ((absmax.size + 255) // 256,)
    # Decoding bitsandbytes' own double-quantized state gives what bitsandbytes gives.
    theirs = bnb_functional.dequantize_blockwise(state.absmax, state.state2).numpy() + state.offset.numpy()
    ours = dequantize_double_quant(state.absmax.numpy(), state.state2.absmax.numpy(), state.offset.item(),
                                   state.state2.code.numpy())
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
