"""Quantize a linear's weight from blocks of rows read off the checkpoint, never holding the whole source.

Quantizing a whole weight holds the source, its codes and (int8) the packed words
at once: twice the source's size for bf16. Here a block of about BLOCK_BYTES of
rows is read, quantized and copied into the full-size codes, then dropped, so one
tensor costs its codes plus one block. The bytes equal a whole-tensor
quantization: int8 scales are per row, and every NF4 block of 64 values (and
every packed byte) lies within one block of rows, whose value count is kept a
multiple of 128.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from qconvert.formats.qarray import QArray
from qconvert.quantizers import NF4_BLOCK_SIZE, quantize_int8, quantize_nf4

# Source bytes read and quantized at a time (per worker).
BLOCK_BYTES = 32 << 20


def block_rows(rows: int, cols: int, itemsize: int, kind: str) -> int:
    """Rows per block: about BLOCK_BYTES, and for NF4 a row count whose value count is a multiple of 128."""
    count = max(1, BLOCK_BYTES // max(1, cols * itemsize))
    if kind == "nf4":
        unit = 2 * NF4_BLOCK_SIZE // math.gcd(cols, 2 * NF4_BLOCK_SIZE) if cols else 1
        count = max(unit, count // unit * unit)
    return max(1, min(count, rows))


def quantize_rows(read_rows: Callable[[int, int], np.ndarray], shape: tuple[int, ...], dtype: np.dtype,
                  kind: str, scale_dtype=None) -> QArray:
    """The QArray of a [rows, cols] weight whose rows `read_rows(start, stop)` returns, a block at a time.

    `kind` is "int8" (per-row scales in `scale_dtype`) or "nf4"; the result equals
    quantize_int8 / quantize_nf4 of the whole weight, and so do their errors.
    """
    rows, cols = shape
    dtype = np.dtype(dtype)
    step = block_rows(rows, cols, dtype.itemsize, kind)
    if kind == "nf4":
        n = rows * cols
        packed = np.empty(-(-n // 2), np.uint8)
        absmax = np.empty(-(-n // NF4_BLOCK_SIZE), np.float32)
        for start in range(0, rows, step):
            part = quantize_nf4(read_rows(start, min(rows, start + step)))
            first = start * cols  # a multiple of 128 for every block but the first (0)
            packed[first // 2:first // 2 + part.qvalue.size] = part.qvalue
            absmax[first // NF4_BLOCK_SIZE:first // NF4_BLOCK_SIZE + part.scale.size] = part.scale
            del part
        return QArray(qvalue=packed, scale=absmax, kind="nf4", block_size=NF4_BLOCK_SIZE, shape=(rows, cols),
                      dtype=dtype)
    if kind != "int8":
        raise ValueError(f"unknown quantization kind {kind!r}")
    scale_dtype = np.dtype(scale_dtype if scale_dtype is not None else dtype)
    codes = np.empty((rows, cols), np.int8)
    scale = np.empty((rows, 1), scale_dtype)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        part = quantize_int8(read_rows(start, stop), scale_dtype=scale_dtype)
        codes[start:stop] = part.qvalue
        scale[start:stop] = np.asarray(part.scale).reshape(-1, 1)
        del part
    return QArray(qvalue=codes, scale=scale, kind="int8", shape=(rows, cols), dtype=dtype)
