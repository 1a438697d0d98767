"""The per-row quantizer driver every scheme shares, and the streaming of a weight a block of rows at a time.

The quantizers divide (w / scale, x / absmax) and then round or compare, and the
FORMATS.md rules are stated on the correctly rounded float32 quotient. XLA turns
a division by a broadcast value into a multiplication by its reciprocal, which is
an ulp off now and then; formats' `f32_quotient` gets the exact float32 quotient
from one float64 multiply instead (traced inside `x64()`; proof in its
docstring), so the kernels stay single fused passes over the weight.

Weights are processed in chunks of a bucketed size (whole rows, or whole NF4
blocks), so a model compiles a handful of kernels, not one per tensor shape, and
the XLA buffers stay small whatever the tensor size.

Quantizing a whole weight holds the source, its codes and (packed layouts) the
packed words at once: twice the source's size for bf16. `quantize_rows` reads a
block of about BLOCK_BYTES of rows, quantizes it and copies it into the
full-size codes, then drops it, so one tensor costs its codes plus one block.
The bytes equal a whole-tensor quantization: per-row and per-group scales lie
within one block of rows, and every NF4 block of 64 values (and every packed
byte) lies within one block of rows, whose value count is kept a multiple of 128.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidWeightError
from qconvert.formats.qarray import NF4_BLOCK_SIZE, QArray

# Elements per jitted call: large enough that dispatch costs nothing, small enough to stay in cache-sized buffers.
CHUNK_ELEMENTS = 1 << 20

# Source bytes read and quantized at a time (per worker).
BLOCK_BYTES = 32 << 20


def block_rows(rows: int, cols: int, itemsize: int, unit_values: int = 1) -> int:
    """Rows per block: about BLOCK_BYTES, and a row count whose value count is a multiple of unit_values."""
    count = max(1, BLOCK_BYTES // max(1, cols * itemsize))
    if unit_values > 1:
        unit = unit_values // math.gcd(cols, unit_values) if cols else 1
        count = max(unit, count // unit * unit)
    return max(1, min(count, rows))


def quantize_rows(quantize: Callable[[np.ndarray], QArray], read_rows: Callable[[int, int], np.ndarray],
                  shape: tuple[int, int], dtype: np.dtype) -> QArray:
    """The QArray of a [rows, cols] weight whose rows `read_rows(start, stop)` returns, a block at a time.

    `quantize` turns one block of rows into its QArray (codes at the logical
    shape, one scale per row or per row and group); the blocks' codes and
    scales are joined along the rows, so the result equals quantize(whole).
    """
    rows, cols = shape
    step = block_rows(rows, cols, np.dtype(dtype).itemsize)
    codes = scale = zero = first = None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = quantize(read_rows(start, stop))
        if first is None:
            first = part
            codes = np.empty((rows, cols), np.asarray(part.qvalue).dtype)
            scale = np.empty((rows,) + np.shape(part.scale)[1:], np.asarray(part.scale).dtype)
            if part.zero_point is not None:
                zero = np.empty((rows,) + np.shape(part.zero_point)[1:], np.asarray(part.zero_point).dtype)
        codes[start:stop] = part.qvalue
        scale[start:stop] = np.asarray(part.scale)
        if zero is not None:
            zero[start:stop] = np.asarray(part.zero_point)
        del part
    return QArray(qvalue=codes, scale=scale, zero_point=zero, kind=first.kind, block_size=first.block_size,
                  shape=(rows, cols), dtype=np.dtype(dtype))


def quantize_nf4_rows(quantize: Callable[[np.ndarray], QArray], read_rows: Callable[[int, int], np.ndarray],
                      shape: tuple[int, int], dtype: np.dtype) -> QArray:
    """quantize_rows for NF4's flat form: packed bytes and block absmax over the row-major flattened weight."""
    rows, cols = shape
    step = block_rows(rows, cols, np.dtype(dtype).itemsize, 2 * NF4_BLOCK_SIZE)
    n = rows * cols
    packed = np.empty(-(-n // 2), np.uint8)
    absmax = np.empty(-(-n // NF4_BLOCK_SIZE), np.float32)
    kind = None
    for start in range(0, rows, step):
        part = quantize(read_rows(start, min(rows, start + step)))
        kind = part.kind
        first = start * cols  # a multiple of 128 for every block but the first (0)
        packed[first // 2:first // 2 + part.qvalue.size] = part.qvalue
        absmax[first // NF4_BLOCK_SIZE:first // NF4_BLOCK_SIZE + part.scale.size] = part.scale
        del part
    return QArray(qvalue=packed, scale=absmax, kind=kind, block_size=NF4_BLOCK_SIZE, shape=(rows, cols),
                  dtype=np.dtype(dtype))


def x64():
    """The context the kernels must be traced and called in (float64 on, this thread only)."""
    return jax.enable_x64(True)



def all_finite_hint(w: jax.Array) -> jax.Array:
    # Any NaN or Inf makes a float sum NaN/Inf whatever the order of additions
    # (a reduced max does not reliably carry a NaN); a huge finite weight can
    # overflow it too, so a False here is confirmed exactly (`_all_finite`).
    # The barrier keeps this reduction reading w itself, not a float32 copy shared with the max.
    return jnp.isfinite(jnp.sum(jax.lax.optimization_barrier(w), dtype=jnp.float32))



@jax.jit
def _all_finite(w: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(w))



def scale_floor(scale_dtype) -> float:
    # Clamp all-zero rows away from a zero scale; the floor must survive the cast
    # to fp16, whose smallest subnormal is ~6e-8.
    return max(1e-8, float(jnp.finfo(scale_dtype).smallest_subnormal))



def bucket(count: int, full: int) -> int:
    """The padded length of a tail chunk of `count` items: a power of two, at most `full`."""
    return min(full, 1 << max(0, count - 1).bit_length())



def pad_rows(part: np.ndarray, length: int) -> np.ndarray:
    """`part` with zero rows appended up to `length` rows (itself when it has that many)."""
    if part.shape[0] == length:
        return part
    out = np.zeros((length,) + part.shape[1:], part.dtype)
    out[: part.shape[0]] = part
    return out



def host_weight(w) -> np.ndarray:
    w = np.asarray(w)
    # float64 input is taken as float32, as JAX takes it with 64-bit types off.
    return np.ascontiguousarray(w.astype(np.float32) if w.dtype == np.float64 else w)



def check_finite(w: np.ndarray, hints) -> None:
    if all(bool(h) for h in hints):
        return
    with x64():
        finite = bool(_all_finite(w))
    if not finite:
        raise InvalidWeightError("the weight has NaN or Inf values")



def quantize_row_chunks(w: np.ndarray, kernel, codes_dtype, scale_cols: int, scale_dtype, clip=None
                        ) -> tuple[np.ndarray, ...]:
    """(codes [rows, cols], scales [rows, scale_cols]) of a 2-D weight from a per-row jitted `kernel`, and
    zero points [rows, scale_cols] when the kernel gives them.

    `kernel(part, scale_dtype, clip_part)` returns (codes, scales, finite hint) of a
    block of rows, or (codes, scales, zero points, finite hint). Rows go through it
    in chunks of a power-of-two row count (about
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
            length = bucket(part.shape[0], step)
            part_clip = None if ratios is None else pad_rows(ratios[start:start + step], length)
            pending.append((start, part.shape[0], kernel(pad_rows(part, length), scale_dtype, part_clip)))
        zero = np.empty((rows, scale_cols), np.int8) if pending and len(pending[0][2]) == 4 else None
        for start, count, outputs in pending:
            codes[start:start + count] = np.asarray(outputs[0])[:count]
            scale[start:start + count] = np.asarray(outputs[1])[:count]
            if zero is not None:
                zero[start:start + count] = np.asarray(outputs[2])[:count]
        check_finite(w, [outputs[-1] for _, _, outputs in pending])
    return (codes, scale) if zero is None else (codes, scale, zero)


def quantize_per_row(w, kernel, codes_dtype, kind: str, *, scale_dtype=None, clip=None,
                     group_size: int | None = None) -> QArray:
    """The QArray of a [out, in] weight from a per-row jitted `kernel` (quantize_row_chunks'): one scale per
    output row, or per row and group of `group_size` input columns; scale_dtype defaults to w's dtype.

    `clip` ([out] or [out, groups] ratios, optional) comes from a scale search. ValueError for a weight
    that is not 2-D or a group that does not divide its width; InvalidWeightError for NaN/Inf values.
    """
    w = host_weight(w)
    if w.ndim != 2:
        raise ValueError(f"{kind} quantization takes a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    cols = w.shape[1]
    if group_size is not None and cols % group_size:
        raise ValueError(f"{kind} group size {group_size} does not divide the input width {cols}")
    scale_cols = 1 if group_size is None else cols // group_size
    scale_dtype = jnp.dtype(scale_dtype if scale_dtype is not None else w.dtype)
    codes, scale, *zero = quantize_row_chunks(w, kernel, codes_dtype, scale_cols, scale_dtype, clip)
    return QArray(qvalue=codes, scale=scale, zero_point=zero[0] if zero else None, kind=kind,
                  block_size=group_size, shape=w.shape, dtype=w.dtype)
