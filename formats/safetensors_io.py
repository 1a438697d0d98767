"""Safetensors folders read: a validating lazy reader of one file or an index and its shards.

The reader checks the index and every header before any tensor is touched, so a
truncated or corrupt file is reported from its first few kilobytes; each file is
also opened once with `safe_open` (the library's own checks), and tensors are
then read one at a time with positional reads of the byte ranges the header
gives, into fresh 64-byte-aligned arrays. Nothing stays mapped, so a pass over a
large checkpoint keeps only the tensors still referenced in memory (the pages of
a memory map would stay resident), and JAX can use the arrays without a copy.

The shard writer is formats/safetensors_writer.py; its names are imported from here too.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
from safetensors import safe_open

from qconvert.formats.errors import FormatError
from qconvert.formats.jsonfile import NOT_OBJECT, JsonFileError, read_json_object
from qconvert.formats.safetensors_header import (  # noqa: F401  (re-exported)
    MAX_HEADER_BYTES,
    SafetensorsHeader,
    TensorEntry,
    read_header,
    safetensors_dtype_name,
)
from qconvert.formats.safetensors_writer import (  # noqa: F401  (re-exported)
    INDEX_NAME,
    SINGLE_NAME,
    TensorSpec,
    encode_header,
    sha256_file,
    shard_file_names,
    split_into_shards,
    write_shards,
)


def _index_file_path(folder: Path, index_path: Path, fname) -> Path:
    """The shard path an index names, refusing names that leave the folder.

    The check is lexical on purpose: Hugging Face cache snapshots are symlinks
    into a blob store, so resolving links would wrongly flag every cached file.
    """
    if not isinstance(fname, str) or not fname or "\\" in fname or "\x00" in fname:
        raise FormatError(f"{index_path}: invalid file name {fname!r} in weight_map")
    if os.path.isabs(fname) or ".." in Path(fname).parts:
        raise FormatError(
            f"{index_path}: weight_map names {fname!r}, a path outside the checkpoint folder; "
            "fix the index"
        )
    return folder / fname


class SafetensorsCheckpoint:
    """A folder of safetensors files (one file, or shards with an index), read lazily."""

    def __init__(self, folder: Path, files: list[Path], tensor_files: dict[str, Path],
                 headers: dict[Path, SafetensorsHeader]):
        self.folder = folder
        self.files = files
        self.tensor_names = sorted(tensor_files)
        self._tensor_files = tensor_files
        self._headers = headers
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._tensor_files

    def __len__(self) -> int:
        return len(self._tensor_files)

    def _entry(self, name: str) -> TensorEntry:
        if name not in self._tensor_files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}")
        return self._headers[self._tensor_files[name]].entries[name]

    def file_of(self, name: str) -> Path:
        """The file that holds tensor `name`."""
        self._entry(name)
        return self._tensor_files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the header."""
        return self._entry(name).shape

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype of tensor `name` (bf16 as ml_dtypes.bfloat16)."""
        return self._entry(name).dtype

    def nbytes(self, name: str) -> int:
        """Bytes of tensor `name`'s data."""
        entry = self._entry(name)
        return entry.end - entry.begin

    def metadata(self, path: Path) -> dict[str, str]:
        """The `__metadata__` of one of this checkpoint's files."""
        return dict(self._headers[Path(path)].metadata)

    def _file(self, path: Path):
        """An open unbuffered handle on one of the files, checked once by `safe_open`."""
        handle = self._handles.get(path)
        if handle is None:
            try:
                with safe_open(str(path), framework="numpy"):
                    pass
                handle = open(path, "rb", buffering=0)
            except Exception as exc:  # the binding raises its own error types
                raise FormatError(f"{path}: cannot open safetensors file ({exc})") from exc
            self._handles[path] = handle
        return handle

    def get(self, name: str) -> np.ndarray:
        """Read tensor `name` into a new array (only its bytes are read; safe to call from threads)."""
        shape = self._entry(name).shape
        return self.get_rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def get_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of tensor `name` (along its first axis) into a new array; safe from threads.

        A row-major tensor's rows are one contiguous byte range, so a large weight can be read a
        block of rows at a time.
        """
        path = self.file_of(name)
        entry = self._entry(name)
        shape = entry.shape if entry.shape else (1,)
        if not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"rows {start}:{stop} are outside tensor {name!r} of shape {list(entry.shape)}")
        row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
        with self._lock:
            handle = self._file(path)
        array = _aligned_bytes((stop - start) * row_bytes)
        offset = self._headers[path].data_start + entry.begin + start * row_bytes
        try:
            done = 0
            while done < array.size:
                got = _read_at(handle, memoryview(array[done:]), offset + done, self._lock)
                if not got:
                    raise FormatError(f"{path}: cannot read tensor {name!r} (the file ends early; "
                                      "re-download or re-create it)")
                done += got
        except OSError as exc:
            raise FormatError(f"{path}: cannot read tensor {name!r} ({exc.strerror or exc})") from exc
        tensor = array.view(entry.dtype).reshape((stop - start,) + tuple(shape[1:]))
        # Safetensors bytes are little-endian; a big-endian host swaps them into native values.
        return tensor if sys.byteorder == "little" else tensor.byteswap()

    def close(self) -> None:
        """Close the open files."""
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _aligned_bytes(nbytes: int, alignment: int = 64) -> np.ndarray:
    """A new uint8 array of `nbytes` whose data starts on an `alignment`-byte boundary."""
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + nbytes]


def _read_at(handle, buffer: memoryview, offset: int, lock: threading.Lock) -> int:
    """Read into `buffer` from `offset` of an open file; returns the byte count (0 at the end)."""
    if hasattr(os, "preadv"):
        return os.preadv(handle.fileno(), [buffer], offset)
    with lock:  # seek + read share the handle's position
        handle.seek(offset)
        return handle.readinto(buffer)


def open_checkpoint(folder) -> SafetensorsCheckpoint:
    """Open a safetensors folder (model.safetensors.index.json + shards, or bare files).

    Every header is validated up front; raises FormatError naming the file at fault.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FormatError(f"{folder}: not a folder")
    index_path = folder / INDEX_NAME
    if index_path.exists():
        return _open_indexed(folder, index_path)
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        raise FormatError(f"{folder}: no .safetensors files")
    headers = {path: read_header(path) for path in files}
    tensor_files: dict[str, Path] = {}
    for path in files:
        for name in headers[path].entries:
            if name in tensor_files:
                raise FormatError(f"{path}: tensor {name!r} also appears in {tensor_files[name].name}")
            tensor_files[name] = path
    return SafetensorsCheckpoint(folder, files, tensor_files, headers)


def _open_indexed(folder: Path, index_path: Path) -> SafetensorsCheckpoint:
    """The shards an index lists, each tensor in the shard the index maps it to, and no other weights beside."""
    tensor_files = _read_index(folder, index_path)
    files = sorted(set(tensor_files.values()))
    single = folder / SINGLE_NAME
    if single.is_file() and single not in files:
        # Two sets of weights: transformers loads the single file, the index's shards would be converted.
        raise FormatError(f"{folder} holds {SINGLE_NAME} beside the shards {INDEX_NAME} lists: two sets of "
                          f"weights, of which transformers loads {SINGLE_NAME}; remove the set that is "
                          "not the model")
    headers = {path: read_header(path) for path in files}
    for name, path in tensor_files.items():
        if name not in headers[path].entries:
            raise FormatError(f"{index_path}: tensor {name!r} is mapped to {path.name}, which lacks it")
    for path in files:  # every tensor a shard holds is indexed, and to that shard
        for name in headers[path].entries:
            if name not in tensor_files:
                raise FormatError(f"{index_path} omits tensor {name!r}, which {path.name} holds; fix the index")
            if tensor_files[name] != path:
                raise FormatError(f"tensor {name!r} is in both {tensor_files[name].name} and {path.name}; "
                                  "keep one copy and fix the index")
    return SafetensorsCheckpoint(folder, files, tensor_files, headers)


def _read_index(folder: Path, index_path: Path) -> dict[str, Path]:
    try:
        index = read_json_object(index_path)
    except JsonFileError as exc:
        if exc.kind != NOT_OBJECT:
            raise FormatError(f"{index_path}: invalid index ({exc.cause})") from exc
        index = None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise FormatError(f"{index_path}: invalid index (no weight_map object)")
    if not weight_map:
        raise FormatError(f"{index_path}: invalid index (weight_map is empty)")
    tensor_files = {name: _index_file_path(folder, index_path, fname) for name, fname in weight_map.items()}
    for path in sorted(set(tensor_files.values())):
        if not path.is_file():
            raise FormatError(f"{index_path}: names {path.name}, which is missing from {folder}")
    return tensor_files
