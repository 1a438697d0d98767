"""Quantize a linear's weight from blocks of rows read off the checkpoint, never holding the whole source.

Quantizing a whole weight holds the source, its codes and (packed layouts) the
packed words at once: twice the source's size for bf16. Here a block of about
BLOCK_BYTES of rows is read, quantized and copied into the full-size codes,
then dropped, so one tensor costs its codes plus one block. The bytes equal a
whole-tensor quantization: per-row and per-group scales lie within one block of
rows, and every NF4 block of 64 values (and every packed byte) lies within one
block of rows, whose value count is kept a multiple of 128.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from qconvert.formats.qarray import NF4_BLOCK_SIZE, QArray

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
    codes = scale = first = None
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = quantize(read_rows(start, stop))
        if first is None:
            first = part
            codes = np.empty((rows, cols), np.asarray(part.qvalue).dtype)
            scale = np.empty((rows,) + np.shape(part.scale)[1:], np.asarray(part.scale).dtype)
        codes[start:stop] = part.qvalue
        scale[start:stop] = np.asarray(part.scale)
        del part
    return QArray(qvalue=codes, scale=scale, kind=first.kind, block_size=first.block_size, shape=(rows, cols),
                  dtype=np.dtype(dtype))


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
