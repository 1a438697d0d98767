"""The safetensors shard writer: tensors streamed in spec order into byte-deterministic shards and their index.

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
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from qconvert.formats.safetensors_header import safetensors_dtype_name

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # what a one-file save writes (and transformers loads first)
# Written into every shard: transformers refuses a file whose metadata lacks a known format.
DEFAULT_METADATA = {"format": "pt"}
# Tensors this large are hashed on a second thread while the same bytes are written.
HASH_BESIDE_BYTES = 1 << 20


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
