"""Weight quantization math: per-output-channel symmetric int8 and NF4 blocks of 64, in jitted JAX.

Both schemes divide (w / scale, x / absmax) and then round or compare, and the
FORMATS.md rules are stated on the correctly rounded float32 quotient. XLA turns
a division by a broadcast value into a multiplication by its reciprocal, which is
an ulp off now and then; formats' `f32_quotient` gets the exact float32 quotient
from one float64 multiply instead (traced inside `x64()`; proof in its
docstring), so the kernels stay single fused passes over the weight.

Weights are processed in chunks of a bucketed size (whole rows for int8, whole
blocks for NF4), so a model compiles a handful of kernels, not one per tensor
shape, and the XLA buffers stay small whatever the tensor size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidWeightError
from qconvert.formats.packing import pack_nf4_codes
from qconvert.formats.qarray import (
    INT8_QMAX,
    NF4_BLOCK_SIZE,
    NF4_LEVELS,
    NF4_ZERO_CODE,
    QArray,
)
from qconvert.formats.quotient import f32_quotient, int8_round

# Elements per jitted call: large enough that dispatch costs nothing, small enough to stay in cache-sized buffers.
CHUNK_ELEMENTS = 1 << 20

# Decision thresholds between neighbouring NF4 levels: a value goes to the
# number of thresholds it lies strictly above, so a tie lands on the lower code.
# bitsandbytes' floor for the absmax of a weight's partial last block (torch's clamp(min=1e-38)).
TAIL_ABSMAX_FLOOR = np.float32(1e-38)
NF4_THRESHOLDS = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / np.float32(2)).astype(np.float32)


def x64():
    """The context the kernels must be traced and called in (float64 on, this thread only)."""
    return jax.enable_x64(True)


def _all_finite_hint(w: jax.Array) -> jax.Array:
    # Any NaN or Inf makes a float sum NaN/Inf whatever the order of additions
    # (a reduced max does not reliably carry a NaN); a huge finite weight can
    # overflow it too, so a False here is confirmed exactly (`_all_finite`).
    # The barrier keeps this reduction reading w itself, not a float32 copy shared with the max.
    return jnp.isfinite(jnp.sum(jax.lax.optimization_barrier(w), dtype=jnp.float32))


@jax.jit
def _all_finite(w: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(w))


def _scale_floor(scale_dtype) -> float:
    # Clamp all-zero rows away from a zero scale; the floor must survive the cast
    # to fp16, whose smallest subnormal is ~6e-8.
    return max(1e-8, float(jnp.finfo(scale_dtype).smallest_subnormal))


@functools.partial(jax.jit, static_argnames=("scale_dtype",))
def int8_codes_and_scales(w: jax.Array, scale_dtype, clip: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per output row: scale = absmax / 127 (rounded to scale_dtype), q = round_half_even(w / scale).

    `clip` (float32 [rows, 1], optional) shrinks each row's absmax first (a
    searched clipping ratio); codes beyond it clamp to +-127. The third result
    is False when w may hold NaN/Inf (see `_all_finite_hint`). Call inside `x64()`.
    """
    # max|w| is exact in w's own dtype; reducing it there keeps XLA from materializing a float32 copy.
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    scale = jnp.maximum(f32_quotient(absmax, jnp.float32(INT8_QMAX)), _scale_floor(scale_dtype))
    scale = scale.astype(scale_dtype)
    # Divide by the scale exactly as loaders will multiply it back: the rounded one.
    q = int8_round(w, scale)
    return q.astype(jnp.int8), scale, _all_finite_hint(w)


def _bucket(count: int, full: int) -> int:
    """The padded length of a tail chunk of `count` items: a power of two, at most `full`."""
    return min(full, 1 << max(0, count - 1).bit_length())


def pad_rows(part: np.ndarray, length: int) -> np.ndarray:
    """`part` with zero rows appended up to `length` rows (itself when it has that many)."""
    if part.shape[0] == length:
        return part
    out = np.zeros((length,) + part.shape[1:], part.dtype)
    out[: part.shape[0]] = part
    return out


def _host_weight(w) -> np.ndarray:
    w = np.asarray(w)
    # float64 input is taken as float32, as JAX takes it with 64-bit types off.
    return np.ascontiguousarray(w.astype(np.float32) if w.dtype == np.float64 else w)


def _check_finite(w: np.ndarray, hints) -> None:
    if all(bool(h) for h in hints):
        return
    with x64():
        finite = bool(_all_finite(w))
    if not finite:
        raise InvalidWeightError("the weight has NaN or Inf values")


def quantize_row_chunks(w: np.ndarray, kernel, codes_dtype, scale_cols: int, scale_dtype, clip=None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, cols], scales [rows, scale_cols]) of a 2-D weight from a per-row jitted `kernel`.

    `kernel(part, scale_dtype, clip_part)` returns (codes, scales, finite hint) of a
    block of rows. Rows go through it in chunks of a power-of-two row count (about
    CHUNK_ELEMENTS values); a tail chunk is padded with zero rows, whose codes are
    dropped. `clip` ([rows, scale_cols] ratios, optional) is chunked alongside.
    Raises InvalidWeightError for NaN/Inf values.
    """
    rows, cols = w.shape
    step = 1 << max(0, (CHUNK_ELEMENTS // max(cols, 1)).bit_length() - 1)
    codes = np.empty((rows, cols), codes_dtype)
    scale = np.empty((rows, scale_cols), scale_dtype)
    ratios = None if clip is None else np.asarray(clip, np.float32).reshape(rows, scale_cols)
    pending = []
    with x64():
        # Dispatch every chunk first: XLA runs them while later ones are still being handed over.
        for start in range(0, rows, step):
            part = w[start:start + step]
            length = _bucket(part.shape[0], step)
            part_clip = None if ratios is None else pad_rows(ratios[start:start + step], length)
            pending.append((start, part.shape[0], kernel(pad_rows(part, length), scale_dtype, part_clip)))
        for start, count, (q_part, scale_part, _) in pending:
            codes[start:start + count] = np.asarray(q_part)[:count]
            scale[start:start + count] = np.asarray(scale_part)[:count]
        _check_finite(w, [hint for _, _, (_, _, hint) in pending])
    return codes, scale


def quantize_int8(w, *, scale_dtype=None, clip=None) -> QArray:
    """Symmetric per-output-channel int8 of a [out, in] weight; scale_dtype defaults to w's dtype.

    `clip` (float32 [out], optional): per-row clipping ratios from a scale
    search; the scale is then clip * absmax / 127.

    Rows go through the kernel in chunks of a power-of-two row count (about
    CHUNK_ELEMENTS values); a tail chunk is padded with zero rows, whose codes are dropped.
    Raises InvalidWeightError for NaN/Inf values.
    """
    w = _host_weight(w)
    if w.ndim != 2:
        raise ValueError(f"int8 quantization takes a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    scale_dtype = jnp.dtype(scale_dtype if scale_dtype is not None else w.dtype)
    q, scale = quantize_row_chunks(w, int8_codes_and_scales, np.int8, 1, scale_dtype, clip)
    return QArray(qvalue=q, scale=scale, kind="int8", shape=w.shape, dtype=w.dtype)


def _block_absmax(blocks: jax.Array) -> jax.Array:
    # Halving elementwise maxima: XLA's CPU reduction over a short minor axis is far
    # slower, and so is a maximum taken in bf16/fp16 (float32 max is native; exact either way).
    x = jnp.abs(blocks.astype(jnp.float32))
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = jnp.maximum(x[:, :half], x[:, half:])
    return x[:, 0]


@functools.partial(jax.jit, static_argnames=("block_size",))
def nf4_codes_and_absmax(flat: jax.Array, block_size: int = NF4_BLOCK_SIZE, clip: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NF4 codes (uint8, one per element) of whole blocks, float32 absmax per block, and a finite hint.

    `flat` holds a whole number of blocks. `clip` (float32 [blocks], optional)
    scales each block's stored absmax (a searched ratio); values beyond it take
    the code of +-1. Call inside `x64()`.

    A block is scaled as bitsandbytes scales a whole block, by a multiply with
    float32 1/absmax, so the codes are its codes (a weight's partial last block
    is scaled apart, by nf4_tail_block).
    """
    blocks = flat.reshape(-1, block_size)
    if block_size & (block_size - 1) == 0:
        absmax = _block_absmax(blocks)
    else:
        absmax = jnp.max(jnp.abs(blocks), axis=1).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    # An all-zero block normalizes to 0 (code 7, the level 0.0) instead of NaN.
    inverse = f32_quotient(jnp.float32(1.0), jnp.where(absmax == 0, 1.0, absmax).astype(jnp.float32))
    normalized = blocks.astype(jnp.float32) * inverse[:, None]
    return nf4_codes(normalized).reshape(-1), absmax, _all_finite_hint(flat)


def nf4_tail_block(values: np.ndarray, clip: float | None = None) -> tuple[np.ndarray, np.float32]:
    """Codes and absmax of a weight's partial last block, as bitsandbytes computes them.

    There the values are divided (not multiplied by a reciprocal) by an absmax
    raised to at least 1e-38. In numpy: 1e-38 is subnormal, which XLA's CPU
    arithmetic flushes to zero.
    """
    values = np.asarray(values, dtype=np.float32)
    absmax = np.abs(values).max() if clip is None else np.abs(values).max() * np.float32(clip)
    absmax = np.maximum(np.float32(absmax), TAIL_ABSMAX_FLOOR)
    codes = np.searchsorted(NF4_THRESHOLDS, values / absmax, side="left").astype(np.uint8)
    return codes, absmax


def _pick(bits: list[jax.Array], table: list[float]) -> jax.Array:
    # The table entry indexed by the bits read as a binary number, most significant first.
    if not bits:
        return jnp.float32(table[0])
    half = len(table) // 2
    return jnp.where(bits[0], _pick(bits[1:], table[half:]), _pick(bits[1:], table[:half]))


def nf4_codes(normalized: jax.Array) -> jax.Array:
    """The number of NF4 thresholds each value lies strictly above (its code), as uint8.

    A branch-free binary search over the 15 sorted thresholds: four comparisons,
    each against the threshold the bits found so far select, all in one fused
    elementwise loop (cheaper than 15 comparisons, and a reduction over a
    thresholds axis does not fuse at all).
    """
    bits: list[jax.Array] = []
    for level in range(4):
        step = 8 >> level
        table = [float(NF4_THRESHOLDS[p * 2 * step + step - 1]) for p in range(1 << level)]
        bits.append(normalized > _pick(bits, table))
    return sum(bit.astype(jnp.uint8) << (3 - level) for level, bit in enumerate(bits)).astype(jnp.uint8)


@jax.jit
def pack_nf4_pairs(codes: jax.Array, valid: jax.Array) -> jax.Array:
    """uint8 codes [2k] -> bytes [k], byte = (code[2i] << 4) | code[2i+1].

    With an odd count `valid` of real codes, the low nibble after the last one is
    the code of 0.0, as bitsandbytes writes it (it pads the values with a zero).
    """
    pairs = codes.reshape(-1, 2)
    packed = (pairs[:, 0] << 4) | pairs[:, 1]
    last = jnp.minimum(valid // 2, packed.shape[0] - 1)
    return packed.at[last].set(jnp.where(valid % 2 == 1, (packed[last] & 0xF0) | NF4_ZERO_CODE, packed[last]))


def quantize_nf4(w, block_size: int = NF4_BLOCK_SIZE, *, clip=None) -> QArray:
    """NF4 of a weight: absmax per block of `block_size` over the row-major flattened values.

    `clip` (float32 [blocks], optional): per-block ratios from a scale search;
    the stored absmax is then clip * max|block|.

    The flat values go through the kernel in chunks of whole blocks (an even
    count); a tail chunk is padded with zeros to a power-of-two number of blocks,
    and the padding's codes and blocks are dropped (zeros do not change a partial
    block's absmax). Raises InvalidWeightError for NaN/Inf values.
    """
    w = _host_weight(w)
    if w.size == 0:
        raise ValueError(f"NF4 quantization takes a non-empty weight, got shape {tuple(w.shape)}")
    flat = w.reshape(-1)
    n = flat.size
    unit = 2 * block_size  # whole blocks and whole bytes in every chunk
    step = max(unit, CHUNK_ELEMENTS // unit * unit)
    packed = np.empty(-(-n // 2), np.uint8)
    absmax = np.empty(-(-n // block_size), np.float32)
    pending = []
    ratios = None if clip is None else np.asarray(clip, np.float32).reshape(-1)
    with x64():
        for start in range(0, n, step):
            part = flat[start:start + step]
            length = unit * _bucket(-(-part.size // unit), step // unit)
            part_clip = None if ratios is None else pad_rows(
                ratios[start // block_size:(start + part.size + block_size - 1) // block_size], length // block_size)
            codes, part_absmax, hint = nf4_codes_and_absmax(pad_rows(part, length), block_size, part_clip)
            pending.append((start, part.size, pack_nf4_pairs(codes, np.int32(part.size)), part_absmax, hint))
        for start, count, part_packed, part_absmax, _ in pending:
            packed[start // 2:(start + count + 1) // 2] = np.asarray(part_packed)[:(count + 1) // 2]
            absmax[start // block_size:-(-(start + count) // block_size)] = (
                np.asarray(part_absmax)[:-(-count // block_size)])
        _check_finite(w, [item[-1] for item in pending])
    if n % block_size:
        first = n - n % block_size
        codes, absmax[-1] = nf4_tail_block(flat[first:], None if ratios is None else ratios[-1])
        packed[first // 2:] = pack_nf4_codes(codes)
    return QArray(qvalue=packed, scale=absmax, kind="nf4", block_size=block_size, shape=w.shape, dtype=w.dtype)
