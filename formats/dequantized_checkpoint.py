"""DequantizedCheckpoint: a quantized source (block FP8, compressed-tensors FP8, pack-quantized int4, NVFP4,
MXFP4, gpt-oss MXFP4) seen as the float checkpoint it stands for, each quantized weight dequantized a block of rows at a
time as it is read (fp8 to bfloat16; the 4-bit formats to the checkpoint's dtype, their packed weights under the
float weight's name: formats/int4_sources.py, formats/fp4_sources.py).

It answers what SafetensorsCheckpoint answers (names, shapes, dtypes, bytes, files, tensors, rows), so the plan,
calibration, the methods, the writer and verify read it as they read a float folder. The scale tensors
(`weight_scale_inv`, `weight_scale`, `input_scale`) and a packed weight's parts are not in its view; every
other tensor is read as stored. Nothing dense is written anywhere: a read holds the rows asked for in the read
dtype and one chunk in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.formats.fp4_sources import BLOCKS, SCALES, fp4_weights, mxfp4_weights
from qconvert.formats.int4_sources import PACKED, SHAPE, ZERO_POINT, PackedWeight, check_claimed, int4_weights
from qconvert.formats.quantized_sources import (
    ACTIVATION_SCALE_SUFFIXES, DEQUANTIZED_DTYPE, FP8, FP8_WEIGHT_DTYPE, INT_PACKED, MXFP4_PACKED, NVFP4, SCALE_DTYPES,
    SourceFormat, check_finite, check_power_of_two, dequantize_block_rows, dequantize_rows,
)
from qconvert.formats.safetensors_io import SafetensorsCheckpoint

# Codes read and dequantized at a time (4 MB of fp8; 16 MB of float32 on the per-channel path): a large
# weight's codes are never held whole beside its bfloat16 rows.
CHUNK_ELEMENTS = 1 << 22


# compressed-tensors' per-column group index (actorder 'group'), which qconvert does not read.
G_IDX = ".weight_g_idx"


class DequantizedCheckpoint:
    """A quantized checkpoint read as float: SafetensorsCheckpoint's reading surface over `stored`."""

    def __init__(self, stored: SafetensorsCheckpoint, source_format: SourceFormat,
                 dtype: np.dtype = DEQUANTIZED_DTYPE):
        self.stored = stored
        self.source_format = source_format
        self.folder = stored.folder
        self.files = stored.files
        # weight name -> (its scale tensor's name, rows x columns each scale covers)
        self._quantized: dict[str, tuple[str, tuple[int, int]]] = {}
        # a 4-bit format's float weight name -> its packed weight; the dtype it is read as
        self._packed: dict[str, PackedWeight] = {}
        self._dtype = np.dtype(DEQUANTIZED_DTYPE if source_format.kind == FP8 else dtype)
        if source_format.kind != FP8:
            self._open_packed(stored, source_format)
            return
        hidden: set[str] = set()
        for name in stored.tensor_names:
            if stored.dtype(name) == FP8_WEIGHT_DTYPE:
                module = self._fp8_module(name)
                scale_name = module + source_format.scale_suffix
                self._quantized[name] = (scale_name, self._block(name, scale_name))
                hidden |= {scale_name, *(module + s for s in ACTIVATION_SCALE_SUFFIXES if module + s in stored)}
        for name in stored.tensor_names:
            if name not in hidden and name.endswith((source_format.scale_suffix, *ACTIVATION_SCALE_SUFFIXES)):
                raise FormatError(f"{stored.file_of(name)}: {name} is a scale, but its linear has no "
                                  f"float8_e4m3fn weight; the {source_format.name} checkpoint is incomplete")
        self._hidden = frozenset(hidden)
        self.tensor_names = [name for name in stored.tensor_names if name not in hidden]

    def _open_packed(self, stored: SafetensorsCheckpoint, fmt: SourceFormat) -> None:
        """A 4-bit source's packed weights, checked against the config, and the names of the float view."""
        finder, suffixes = {INT_PACKED: (int4_weights, (PACKED, fmt.scale_suffix, ZERO_POINT, SHAPE)),
                            NVFP4: (fp4_weights, (PACKED, fmt.scale_suffix, ".weight_global_scale")),
                            MXFP4_PACKED: (fp4_weights, (PACKED, fmt.scale_suffix))}.get(
            fmt.kind, (mxfp4_weights, (BLOCKS, SCALES)))
        self._packed = finder(stored, fmt)
        self._hidden = check_claimed(stored, fmt, self._packed, suffixes)
        stray = next((n for n in stored.tensor_names if n.endswith(G_IDX)), None)
        if stray is not None:  # activation-order groups the config does not declare: its columns would read wrong
            raise FormatError(f"{stored.file_of(stray)}: {stray} orders the weight's columns by activation groups "
                              f"(actorder 'group'), which config.json's quantization_config does not declare; the "
                              f"{fmt.name} checkpoint is inconsistent")
        self.tensor_names = sorted([n for n in stored.tensor_names if n not in self._hidden] + list(self._packed))

    def _fp8_module(self, name: str) -> str:
        where = self.stored.file_of(name)
        if not name.endswith(".weight"):
            raise FormatError(f"{where}: {name} is float8_e4m3fn but not a linear's weight; qconvert reads fp8 "
                              "weights only")
        if len(self.stored.shape(name)) != 2:
            raise FormatError(f"{where}: {name} is a float8_e4m3fn weight of shape {list(self.stored.shape(name))}, "
                              "not [out, in]")
        return name[: -len(".weight")]

    def _block(self, name: str, scale_name: str) -> tuple[int, int]:
        """The rows x columns each of weight `name`'s scales covers; FormatError when its scale is missing or
        its shape or dtype is not one the format allows."""
        stored, fmt = self.stored, self.source_format
        where = stored.file_of(name)
        shape = tuple(stored.shape(name))
        if scale_name not in stored:
            raise FormatError(f"{where}: {name} is float8_e4m3fn but {scale_name} is missing; a {fmt.name} "
                              "checkpoint has a scale beside every fp8 weight")
        scale_shape = tuple(stored.shape(scale_name))
        grid = fmt.grid_for(shape, scale_shape)
        if grid is None:
            raise FormatError(f"{stored.file_of(scale_name)}: {scale_name} has shape {list(scale_shape)}, but a "
                              f"{fmt.name} scale of a {list(shape)} weight is {fmt.expected_scale_shapes(shape)}")
        if stored.dtype(scale_name) not in SCALE_DTYPES:
            raise FormatError(f"{stored.file_of(scale_name)}: {scale_name} is {stored.dtype(scale_name)}, not a "
                              "float32, bfloat16, float16 or float8_e8m0fnu scale")
        return grid.block_of(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._packed or name in self.stored and name not in self._hidden

    def __len__(self) -> int:
        return len(self.tensor_names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def _check(self, name: str) -> None:
        if name not in self:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}")

    @property
    def quantized_weights(self) -> list[str]:
        """The weights stored quantized (fp8 or packed), read dequantized."""
        return sorted([*self._quantized, *self._packed])

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name` (a dequantized weight: its fp8 or packed codes)."""
        self._check(name)
        return self.stored.file_of(self._packed[name].parts[0] if name in self._packed else name)

    def shape(self, name: str) -> tuple[int, ...]:
        self._check(name)
        return self._packed[name].shape if name in self._packed else self.stored.shape(name)

    def dtype(self, name: str) -> np.dtype:
        """bfloat16 for an fp8 weight, the read dtype for a packed one, else the stored dtype."""
        self._check(name)
        return self._dtype if name in self._quantized or name in self._packed else self.stored.dtype(name)

    def nbytes(self, name: str) -> int:
        """Bytes of tensor `name` as read (a quantized weight: its float copy)."""
        self._check(name)
        if name in self._quantized or name in self._packed:
            return math.prod(self.shape(name)) * self._dtype.itemsize
        return self.stored.nbytes(name)

    def metadata(self, path: Path) -> dict[str, str]:
        return self.stored.metadata(path)

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as float (an fp8 weight dequantized to bfloat16), in a new array."""
        self._check(name)
        if name not in self._quantized and name not in self._packed:
            return self.stored.get(name)
        return self.get_rows(name, 0, self.shape(name)[0])

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `name`, an fp8 weight's dequantized a chunk of rows at a time."""
        self._check(name)
        if name in self._packed:
            return self._packed_rows(name, start, stop)
        if name not in self._quantized:
            return self.stored.get_rows(name, start, stop)
        out_features, in_features = self.stored.shape(name)
        if not 0 <= start <= stop <= out_features:
            raise ValueError(f"rows {start}:{stop} are outside tensor {name!r} of shape "
                             f"{[out_features, in_features]}")
        scale_name, (block_rows, block_cols) = self._quantized[name]
        first = start // block_rows
        scales = self._scale_rows(scale_name, first, -(-stop // block_rows))
        out = np.empty((stop - start, in_features), DEQUANTIZED_DTYPE)
        chunk = max(1, CHUNK_ELEMENTS // max(1, in_features))
        begin = start
        while begin < stop:
            if block_rows == 1:  # a scale per row: a chunk of rows at a time
                end = min(stop, begin + chunk)
                dequantize_rows(self.stored.get_rows(name, begin, end), scales[begin - first:end - first],
                                out[begin - start:end - start])
            else:  # blocks of rows: a chunk within one row of blocks at a time
                end = min(stop, begin + chunk, (begin // block_rows + 1) * block_rows)
                dequantize_block_rows(self.stored.get_rows(name, begin, end), scales[begin // block_rows - first],
                                      block_cols, out[begin - start:end - start])
            begin = end
        return out

    def _packed_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a packed weight, read and dequantized a chunk of rows at a time."""
        weight = self._packed[name]
        if not 0 <= start <= stop <= weight.shape[0]:
            raise ValueError(f"rows {start}:{stop} are outside tensor {name!r} of shape {list(weight.shape)}")
        out = np.empty((stop - start, *weight.shape[1:]), self._dtype)
        chunk = max(1, CHUNK_ELEMENTS // max(1, math.prod(weight.shape[1:])))
        for begin in range(start, stop, chunk):
            end = min(stop, begin + chunk)
            weight.fill(begin, end, out[begin - start:end - start])
        return out

    def _scale_rows(self, scale_name: str, first: int, last: int) -> np.ndarray:
        """Rows [first, last) of a scale grid as float32 [rows, column blocks] (a per-tensor scale: [1, 1])."""
        shape = self.stored.shape(scale_name)
        if len(shape) < 2:  # per tensor: [1] or a scalar
            scale = self.stored.get(scale_name).reshape(1, 1)
        else:
            scale = self.stored.get_rows(scale_name, first, last)
        where = f"{self.stored.file_of(scale_name)}: {scale_name}"
        values = check_finite(scale, where)
        if self.source_format.power_of_two_scales:
            check_power_of_two(values, where)
        return values

    def close(self) -> None:
        """Close the stored checkpoint's files."""
        self.stored.close()

    def __enter__(self) -> "DequantizedCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
