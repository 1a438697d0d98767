"""Safetensors folders: a validating lazy reader and a streaming, byte-deterministic shard writer.

The reader checks the index and every header before any tensor is touched, so a
truncated or corrupt file is reported from its first few kilobytes; each file is
also opened once with `safe_open` (the library's own checks), and tensors are
then read one at a time with positional reads of the byte ranges the header
gives, into fresh 64-byte-aligned arrays. Nothing stays mapped, so a pass over a
large checkpoint keeps only the tensors still referenced in memory (the pages of
a memory map would stay resident), and JAX can use the arrays without a copy.

The writer emits each shard's header first and then the tensor bytes one at a
time, hashing as it goes, so memory stays near one tensor whatever the model size.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Iterable, Mapping
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

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Written into every shard: transformers refuses a file whose metadata lacks a known format.
DEFAULT_METADATA = {"format": "pt"}
# Tensors this large are hashed on a second thread while the same bytes are written.
HASH_BESIDE_BYTES = 1 << 20


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


SINGLE_FILE_NAME = "model.safetensors"  # what a one-file save writes (and transformers loads first)


def open_checkpoint(folder) -> SafetensorsCheckpoint:
    """Open a safetensors folder (model.safetensors.index.json + shards, or bare files).

    Every header is validated up front; raises FormatError naming the file at fault.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FormatError(f"{folder}: not a folder")
    index_path = folder / INDEX_NAME
    if index_path.exists():
        tensor_files = _read_index(folder, index_path)
        files = sorted(set(tensor_files.values()))
        single = folder / SINGLE_FILE_NAME
        if single.is_file() and single not in files:
            # Two sets of weights: transformers loads the single file, the index's shards would be converted.
            raise FormatError(f"{folder} holds {SINGLE_FILE_NAME} beside the shards {INDEX_NAME} lists: two sets of "
                              f"weights, of which transformers loads {SINGLE_FILE_NAME}; remove the set that is "
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


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, numpy dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def split_into_shards(specs: list[TensorSpec], max_shard_size: int) -> list[list[TensorSpec]]:
    """Cut specs, in order, into shards of at most `max_shard_size` data bytes.

    A tensor larger than the limit gets a shard of its own.
    """
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """Hugging Face shard names: model.safetensors alone, else model-0000i-of-0000N.safetensors."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def encode_header(specs: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The length prefix and JSON header of a shard holding `specs` in order (padded to 8 bytes)."""
    fields = {**DEFAULT_METADATA, **(metadata or {})}
    header: dict[str, object] = {"__metadata__": {k: str(fields[k]) for k in sorted(fields)}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": safetensors_dtype_name(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    # Pad with spaces, as safetensors does, so the data section starts 8-aligned.
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _tensor_bytes(spec: TensorSpec, name: str, array) -> np.ndarray:
    """The raw little-endian bytes of `array`, after checking it matches its spec."""
    array = np.asarray(array)
    if name != spec.name:
        raise ValueError(f"tensors arrived out of order: got {name!r}, expected {spec.name!r}")
    if array.dtype.newbyteorder("=") != spec.dtype or tuple(array.shape) != spec.shape:
        raise ValueError(
            f"tensor {name!r} is {array.dtype}{list(array.shape)}, its spec says {spec.dtype}{list(spec.shape)}"
        )
    array = array.astype(spec.dtype.newbyteorder("<"), copy=False)
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def write_shards(
    folder,
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, np.ndarray]],
    max_shard_size: int,
    metadata: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Stream `tensors` ((name, array) pairs in spec order) into safetensors shards in `folder`.

    One shard is model.safetensors; more are model-0000i-of-0000N.safetensors plus
    model.safetensors.index.json. Only one tensor is held at a time; the output
    bytes depend only on the specs, the arrays and `metadata`. Returns
    {file name: sha256} for every file written, the index included.
    """
    folder = Path(folder)
    specs = list(specs)
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError("tensor names in specs must be unique and not '__metadata__'")
    shards = split_into_shards(specs, max_shard_size)
    file_names = shard_file_names(len(shards))
    source = iter(tensors)
    hashes: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qconvert-output-sha256") as hasher:
        for file_name, shard in zip(file_names, shards):
            _write_shard(folder / file_name, shard, metadata, source, hasher, hashes, weight_map)
    for extra in source:
        raise ValueError(f"more tensors than specs (first extra: {extra[0]!r})")
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {name: weight_map[name] for name in sorted(weight_map)},
        }
        text = (json.dumps(index, indent=2) + "\n").encode("utf-8")
        index_path = folder / INDEX_NAME
        index_path.write_bytes(text)
        os.chmod(index_path, 0o644)
        hashes[INDEX_NAME] = hashlib.sha256(text).hexdigest()
    return hashes


def _write_shard(path: Path, shard: list[TensorSpec], metadata, source, hasher, hashes: dict[str, str],
                 weight_map: dict[str, str]) -> None:
    """Write one shard: its header, then each tensor's bytes as they arrive, hashed beside the write."""
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        header = encode_header(shard, metadata)
        f.write(header)
        digest.update(header)
        for spec in shard:
            try:
                name, array = next(source)
            except StopIteration:
                raise ValueError(f"tensors ran out before {spec.name!r}") from None
            data = _tensor_bytes(spec, name, array)
            # The file write and the hash both release the GIL, so they run side by side on the same bytes.
            hashed = hasher.submit(digest.update, data) if data.size >= HASH_BESIDE_BYTES else None
            if hashed is None:
                digest.update(data)
            try:
                f.write(data)
            finally:
                if hashed is not None:
                    hashed.result()
            weight_map[spec.name] = path.name
            del array, data
    os.chmod(path, 0o644)
    hashes[path.name] = digest.hexdigest()


def sha256_file(path, chunk_size: int = 1 << 22) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
