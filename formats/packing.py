"""Bit packing for the export layouts: int8 codes in int32 words, NF4 nibbles, bitsandbytes double quantization.

All functions are pure numpy over arrays; bit layouts are little-endian whatever
the host, since that is what the files hold.
"""

from __future__ import annotations

import numpy as np

# bitsandbytes quantizes the NF4 absmax in blocks of this many values.
NESTED_BLOCK_SIZE = 256
# bitsandbytes' CPU blockwise quantizer finds the map entry through a table of
# this many evenly spaced points over [-1, 1], not by an exact nearest search.
LUT_POINTS = 65536
# torch's float32 vector width on an AVX2 host: the lanes its CPU sum kernel adds side by side.
TORCH_VECTOR_LANES = 8


def _codes_matrix(q) -> np.ndarray:
    """q as an int8 codes array [rows, cols]; ValueError for any other."""
    q = np.asarray(q)
    if q.dtype != np.int8 or q.ndim != 2:
        raise ValueError(f"expected int8 codes [rows, cols], got {q.dtype}{list(q.shape)}")
    return q


def _packed_words(packed, cols: int, per_word: int) -> np.ndarray:
    """packed as int32 words [rows, ceil(cols / per_word)]; ValueError for any other."""
    packed = np.asarray(packed)
    words = -(-cols // per_word)
    if packed.dtype != np.int32 or packed.ndim != 2 or packed.shape[1] != words:
        raise ValueError(f"expected int32 [rows, {words}] for {cols} columns, got {packed.dtype}{list(packed.shape)}")
    return packed


def pack_int8_to_int32(q: np.ndarray) -> np.ndarray:
    """int8 codes [rows, cols] -> int32 [rows, ceil(cols/4)] (compressed-tensors pack_to_int32, 8 bits).

    u = q + 128; column 4k+j of a row lands in bits 8j..8j+7 of word k (least
    significant first); the unused bytes of a row's last partial word are 0.
    """
    q = _codes_matrix(q)
    rows, cols = q.shape
    words = -(-cols // 4)
    # q + 128 modulo 256 is q's bit pattern with the sign bit flipped.
    if cols % 4 == 0:  # whole words: one pass, no zero-filled staging array
        unsigned = np.bitwise_xor(np.ascontiguousarray(q).view(np.uint8), np.uint8(0x80))
    else:
        unsigned = np.zeros((rows, words * 4), dtype=np.uint8)
        unsigned[:, :cols] = q.view(np.uint8) ^ 0x80
    # Reading the little-endian words as int32 keeps their bits (u32 values >= 2**31 wrap, as a cast would).
    return unsigned.view("<i4").astype(np.int32, copy=False).reshape(rows, words)


def unpack_int32_to_int8(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 [rows, ceil(cols/4)] -> int8 codes [rows, cols]; the inverse of pack_int8_to_int32."""
    packed = _packed_words(packed, cols, 4)
    unsigned = np.ascontiguousarray(packed.astype("<i4", copy=False)).view(np.uint8)
    return (unsigned.reshape(packed.shape[0], -1)[:, :cols] ^ 0x80).view(np.int8)


def pack_int4_to_int32(q: np.ndarray) -> np.ndarray:
    """int4 codes (int8 in [-8, 7]) [rows, cols] -> int32 [rows, ceil(cols/8)] (pack_to_int32, 4 bits).

    u = q + 8; column 8k+j of a row lands in bits 4j..4j+3 of word k (least
    significant first); the unused nibbles of a row's last partial word are 0.
    """
    q = _codes_matrix(q)
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError("int4 codes must lie in [-8, 7]")
    rows, cols = q.shape
    words = -(-cols // 8)
    nibbles = np.zeros((rows, words * 8), dtype=np.uint32)
    nibbles[:, :cols] = (q.astype(np.int16) + 8).astype(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    packed = np.bitwise_or.reduce(nibbles.reshape(rows, words, 8) << shifts, axis=2)
    return packed.astype("<u4").view("<i4").astype(np.int32, copy=False).reshape(rows, words)


def unpack_int32_to_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 [rows, ceil(cols/8)] -> int4 codes (int8 in [-8, 7]) [rows, cols]; the inverse of pack_int4_to_int32."""
    packed = _packed_words(packed, cols, 8)
    words = packed.astype("<i4", copy=False).view("<u4").astype(np.uint32)
    nibbles = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols].astype(np.int16) - 8).astype(np.int8)


def pack_nf4_codes(codes: np.ndarray) -> np.ndarray:
    """NF4 codes (0..15, any shape, flattened row-major) -> uint8 [ceil(n/2)].

    byte k = (code[2k] << 4) | code[2k+1]; an odd count pads the low nibble with
    the code of 0.0 (7), as bitsandbytes does.
    """
    codes = np.asarray(codes).reshape(-1)
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("NF4 codes must lie in 0..15")
    padded = np.full(codes.size + codes.size % 2, 7, dtype=np.uint8)
    padded[: codes.size] = codes
    return (padded[0::2] << 4) | padded[1::2]


def unpack_nf4_bytes(packed: np.ndarray, n: int) -> np.ndarray:
    """uint8 [ceil(n/2)] -> uint8 codes [n]; the earlier element is the high nibble."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if packed.size != -(-n // 2):
        raise ValueError(f"{packed.size} bytes cannot hold {n} NF4 codes")
    return np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)[:n]


def _linspace_float32(start: float, end: float, steps: int) -> np.ndarray:
    """Evenly spaced float32 points with a float32 step, the first half counted from
    `start` and the rest back from `end`, each point rounded once (a fused
    multiply-add: the float32 product is exact in float64)."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(steps - 1))
    index = np.arange(steps, dtype=np.float64)
    halfway = steps // 2
    low = np.float64(start32) + index[:halfway] * step
    high = np.float64(end32) - (steps - 1 - index[halfway:]) * step
    return np.concatenate([low, high]).astype(np.float32)


def signed_dynamic_map() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic quantization map: 256 sorted float32 values.

    Exponent e = 0..6 owns 2**e fraction values: the midpoints of 2**e + 1 evenly
    spaced points in [0.1, 1], scaled by 10**(e - 6), with both signs; plus 0 and 1.
    """
    values = [np.float32(0.0), np.float32(1.0)]
    for exponent in range(7):
        boundaries = _linspace_float32(0.1, 1.0, 2**exponent + 1)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        magnitudes = np.float32(10.0 ** (exponent - 6)) * means
        values.extend(magnitudes)
        values.extend(-magnitudes)
    return np.sort(np.array(values, dtype=np.float32))


def _lookup_table(code: np.ndarray) -> np.ndarray:
    """uint8 [LUT_POINTS]: for point i = -1 + 2i/(LUT_POINTS-1) (float32), the number of midpoints of
    neighbouring `code` entries below it, i.e. its nearest entry, a tie going to the lower one."""
    code = np.asarray(code, dtype=np.float32)
    midpoints = np.float32(0.5) * (code[:-1] + code[1:])
    points = np.float32(-1.0) + (np.float32(2.0) * np.arange(LUT_POINTS, dtype=np.float32)) / np.float32(LUT_POINTS - 1)
    return np.searchsorted(midpoints, points, side="left").astype(np.uint8)


def quantize_blockwise(values: np.ndarray, code: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Blockwise absmax quantization to a sorted 256-entry `code`, as bitsandbytes' CPU kernel does it.

    Returns (uint8 indices, float32 absmax per block). Each value is multiplied by
    float32 1/absmax of its block, clipped to [-1, 1], rounded to the nearest of
    LUT_POINTS evenly spaced points, and the point's entry taken from
    _lookup_table: near a midpoint of two entries this may be the farther one,
    and it is what bitsandbytes stores. An all-zero block gets index 0.
    """
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    n = values.size
    blocks = -(-n // block_size)
    padded = np.zeros(blocks * block_size, dtype=np.float32)
    padded[:n] = values
    padded = padded.reshape(blocks, block_size)
    absmax = np.abs(padded).max(axis=1).astype(np.float32)
    inverse = np.float32(1.0) / np.where(absmax > 0, absmax, np.float32(1.0))
    scaled = np.clip(padded * inverse[:, None], np.float32(-1.0), np.float32(1.0))
    # float32 throughout: (x + 1) * 0.5 * (LUT_POINTS - 1) + 0.5, truncated.
    position = (scaled + np.float32(1.0)) * np.float32(0.5) * np.float32(LUT_POINTS - 1) + np.float32(0.5)
    indices = _lookup_table(code)[position.astype(np.uint16)]
    indices[absmax == 0] = 0
    return indices.reshape(-1)[:n], absmax


def dequantize_blockwise(indices: np.ndarray, absmax: np.ndarray, code: np.ndarray, block_size: int) -> np.ndarray:
    """float32 code[index] * absmax[block]: the inverse of quantize_blockwise."""
    indices = np.asarray(indices).reshape(-1)
    block_of = np.arange(indices.size) // block_size
    return (code[indices.astype(np.int64)] * np.asarray(absmax, dtype=np.float32)[block_of]).astype(np.float32)


def double_quantize_absmax(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NF4 double quantization of the per-block absmax, as bitsandbytes' compress_statistics does it on a CPU.

    offset = mean(absmax), summed in torch's float32 order (torch_float32_sum) and
    divided by the count in float32; (absmax - offset) is quantized in blocks of
    256 with the signed dynamic map by quantize_blockwise. Returns (uint8 codes
    [nblocks], float32 nested_absmax [ceil(nblocks/256)], float32 offset).
    """
    absmax = np.asarray(absmax, dtype=np.float32).reshape(-1)
    if not absmax.size:
        return np.zeros(0, np.uint8), np.zeros(0, np.float32), np.float32(0.0)
    offset = np.float32(torch_float32_sum(absmax) / np.float32(absmax.size))
    codes, nested_absmax = quantize_blockwise(absmax - offset, signed_dynamic_map(), NESTED_BLOCK_SIZE)
    return codes, nested_absmax, offset


def _ceil_log2(x: int) -> int:
    return 1 if x <= 2 else (x - 1).bit_length()


def _cascade_rows(rows: np.ndarray) -> np.ndarray:
    """Sum of `rows` [size, ...] along axis 0 in torch's cascade order (multi_row_sum): runs of
    2**p values add into level 0, and each full run moves up one of four levels."""
    size = rows.shape[0]
    power = max(4, _ceil_log2(size) // 4)
    step, mask = 1 << power, (1 << power) - 1
    levels = [np.zeros(rows.shape[1:], np.float32) for _ in range(4)]
    i = 0
    while i + step <= size:
        for row in rows[i:i + step]:
            levels[0] = levels[0] + row
        i += step
        for j in range(1, 4):
            levels[j], levels[j - 1] = levels[j] + levels[j - 1], np.zeros_like(levels[0])
            if i & (mask << (j * power)):
                break
    for row in rows[i:]:
        levels[0] = levels[0] + row
    return levels[0] + levels[1] + levels[2] + levels[3]


def _row_sum(values: np.ndarray) -> np.ndarray:
    """torch's row_sum: four interleaved cascades, the leftovers onto the first, then the four in order."""
    size = values.shape[0]
    whole = size // 4
    partial = _cascade_rows(values[:whole * 4].reshape((whole, 4) + values.shape[1:]))
    first = partial[0]
    for row in values[whole * 4:]:
        first = first + row
    return first + partial[1] + partial[2] + partial[3]


def torch_float32_sum(values: np.ndarray, lanes: int = TORCH_VECTOR_LANES) -> np.float32:
    """The float32 sum of a 1-D array, each addition rounded in the order torch's CPU kernel adds.

    Every float32 addition rounds, so the order decides the last bits. torch sums
    `lanes`-wide vectors (8 with AVX2) by _row_sum, then adds the leftover values
    and the vector's lanes one by one. This is torch's order on one thread; from
    32768 values on, torch splits the sum between its threads.
    """
    values = np.asarray(values, dtype=np.float32).reshape(-1)
    if values.size < lanes:
        return np.float32(_row_sum(values))
    whole = values.size // lanes
    vector = _row_sum(values[:whole * lanes].reshape(whole, lanes))
    total = np.float32(0.0)
    for value in np.concatenate([values[whole * lanes:], vector]):
        total = np.float32(total + value)
    return total


def dequantize_double_quant(codes: np.ndarray, nested_absmax: np.ndarray, offset: float,
                            code: np.ndarray | None = None) -> np.ndarray:
    """absmax_j = map[codes_j] * nested_absmax[j // 256] + offset, in float32."""
    code = signed_dynamic_map() if code is None else np.asarray(code, dtype=np.float32)
    return dequantize_blockwise(codes, nested_absmax, code, NESTED_BLOCK_SIZE) + np.float32(offset)
