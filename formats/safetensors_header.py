"""Safetensors file headers: the dtype table and a validating header parser that reads no tensor data."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from qconvert.formats import outside
from qconvert.formats.errors import FormatError

# safetensors itself refuses headers above 100 MB; a larger length means corruption.
MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # power-of-two scales of some block-FP8 checkpoints
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def safetensors_dtype_name(dtype) -> str:
    """The safetensors dtype string ("BF16", "I32", ...) for a numpy dtype."""
    dt = np.dtype(dtype).newbyteorder("=")
    if dt not in _DTYPE_NAMES:
        raise FormatError(f"dtype {dt} cannot be stored in safetensors")
    return _DTYPE_NAMES[dt]


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it: dtype, shape and byte range in the data."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header: its tensors, metadata and where the data section starts."""

    path: Path
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path) -> SafetensorsHeader:
    """Read and validate one file's header without reading its tensor data.

    Checks: the 8-byte length fits the file, the JSON is an object, every dtype
    is known, every byte range matches dtype x shape, and the ranges tile the
    data section exactly (so a truncated file is caught here).
    """
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError(f"{path}: not a safetensors file (only {len(prefix)} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len == 0 or header_len > MAX_HEADER_BYTES or 8 + header_len > file_size:
                raise FormatError(
                    f"{path}: corrupt or truncated safetensors file (header length {header_len}, "
                    f"file size {file_size}); re-download or re-create it"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise FormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: corrupt safetensors header (invalid JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise FormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    _check_names(path, header)
    entries = {name: _parse_entry(path, name, info) for name, info in header.items()}
    data_start = 8 + header_len
    _check_tiling(path, entries, file_size - data_start)
    return SafetensorsHeader(path=path, entries=entries, metadata=dict(metadata), data_start=data_start)



def _check_names(path: Path, header: dict) -> None:
    """Tensor names come from outside: each must be text a message and a JSON document can carry as it is."""
    for name in header:
        try:
            outside.text(name, "a tensor name", max_bytes=outside.TEXT_MAX_BYTES)
        except outside.OutsideValueError as err:
            raise FormatError(f"{path}: corrupt safetensors header ({err}: {outside.shown(name)!r})") from None


def _parse_entry(path: Path, name: str, info) -> TensorEntry:
    if not isinstance(info, dict):
        raise FormatError(f"{path}: corrupt header entry for tensor {name!r}")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype_name not in _DTYPES:
        raise FormatError(f"{path}: tensor {name!r} has unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise FormatError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise FormatError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    dtype = _DTYPES[dtype_name]
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise FormatError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but "
            f"{dtype_name}{shape} needs {math.prod(shape) * dtype.itemsize}"
        )
    return TensorEntry(name=name, dtype=dtype, shape=tuple(shape), begin=offsets[0], end=offsets[1])


def _check_tiling(path: Path, entries: Mapping[str, TensorEntry], data_size: int) -> None:
    position = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != position:
            raise FormatError(
                f"{path}: corrupt safetensors header (tensor {entry.name!r} starts at byte "
                f"{entry.begin}, expected {position}: overlapping or gapped data)"
            )
        position = entry.end
    if position != data_size:
        what = "truncated" if position > data_size else "has trailing bytes"
        raise FormatError(
            f"{path}: safetensors file {what} (header describes {position} data bytes, "
            f"file holds {data_size}); re-download or re-create it"
        )
