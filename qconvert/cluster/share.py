"""What the processes of a run share: the source they read (its files' sha256, compared), and what one process
computed for the others (arrays, gathered over jax.distributed's collectives in process order).

Everything here is the identity for one process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qconvert.cluster.runtime import active, process_count, process_index
from qconvert.formats.errors import InvalidCheckpointError, UsageError

# How long a process waits for the others' source hashes (they may still be reading a large checkpoint).
SOURCE_WAIT_S = 3600


def _every_process(key: str, value: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every process's `value` (JSON), in process order, through jax.distributed's key-value store (small
    values only; the others may still be reading a large checkpoint, so the wait is long)."""
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"qconvert/{key}/{process_index()}", json.dumps(dict(value), sort_keys=True, default=str))
    return [json.loads(client.blocking_key_value_get(f"qconvert/{key}/{p}", SOURCE_WAIT_S * 1000))
            for p in range(process_count())]


def agree_source(hashes: Mapping[str, str], what: str = "the model") -> None:
    """InvalidCheckpointError (exit 6) when another process's copy of the source's files differs from process
    0's; every process raises the same line. `hashes`: relative path -> sha256 of the files the run reads."""
    if not active():
        return
    copies = _every_process("source", dict(hashes))
    reference = copies[0]
    for p, copy in enumerate(copies[1:], start=1):
        for name in sorted(set(reference) | set(copy)):
            if reference.get(name) != copy.get(name):
                held = ("lacks it" if name not in copy else
                        f"sha256 {copy[name][:12]}... against {reference.get(name, '')[:12]}..."
                        if name in reference else "has it and process 0 does not")
                raise InvalidCheckpointError(
                    f"process {p}'s copy of {what} differs from process 0's at {name} ({held}); give every process "
                    "the same files (a shared folder, or copies with equal sha256)")


def agree_settings(settings: Mapping[str, Any], what: str = "settings") -> None:
    """UsageError (exit 2) when another process was started with other settings than process 0's (a scheme, a
    flag): every process raises the same line, naming the first setting (in `settings`' order) that differs.
    `settings`: JSON-able."""
    if not active():
        return
    copies = _every_process(what, settings)
    for p, copy in enumerate(copies[1:], start=1):
        # In the order this process's `settings` name them (the same code on every process), then any other.
        for key in [*settings, *sorted((set(copies[0]) | set(copy)) - set(settings))]:
            if copies[0].get(key) != copy.get(key):
                raise UsageError(f"process {p} was started with {key} {copy.get(key)!r}, process 0 with "
                                 f"{copies[0].get(key)!r}; start every process with the same flags")


def same_windows(record: Mapping[str, Any]) -> dict[str, Any]:
    """What of a calibration record must agree across processes: everything but where the text lies."""
    return {f"the calibration text's {k}": v for k, v in record.items() if k not in ("source", "description")}


def owners(costs: Sequence[float], devices: int) -> list[int]:
    """Each task's device: the largest first, each to the least loaded device (the lowest index on a tie).

    The same costs and device count give the same owners on every process.
    """
    load = [0.0] * max(1, devices)
    owner = [0] * len(costs)
    for task in sorted(range(len(costs)), key=lambda t: (-costs[t], t)):
        device = min(range(len(load)), key=lambda d: (load[d], d))
        owner[task] = device
        load[device] += costs[task]
    return owner


def gather_bytes(payload: bytes) -> list[bytes]:
    """Every process's `payload`, in process order (one collective of a padded uint8 buffer)."""
    if not active():
        return [payload]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(payload)], np.int32))).reshape(-1)
    size = 1 << max(10, int(lengths.max() - 1).bit_length())  # a few buffer sizes, a few compiled programs
    buffer = np.zeros(size, np.uint8)
    buffer[:len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buffer)).reshape(len(lengths), size)
    return [gathered[p, :int(n)].tobytes() for p, n in enumerate(lengths)]


def pack(arrays: Mapping[str, np.ndarray], meta: Any) -> bytes:
    """Arrays and a JSON-able value as bytes: a JSON header (names, dtypes, shapes, offsets), then the raw data."""
    entries, blobs, offset = [], [], 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        data = array.tobytes()
        entries.append([name, array.dtype.name, list(array.shape), offset, len(data)])
        blobs.append(data)
        offset += len(data)
    header = json.dumps({"arrays": entries, "meta": meta}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(blobs)


def unpack(payload: bytes) -> tuple[dict[str, np.ndarray], Any]:
    """The inverse of `pack`."""
    import jax.numpy as jnp  # its dtype names include bfloat16 and the float8 types

    size = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8:8 + size])
    body = memoryview(payload)[8 + size:]
    arrays = {name: np.frombuffer(body[offset:offset + n], jnp.dtype(dtype)).reshape(shape)
              for name, dtype, shape, offset, n in header["arrays"]}
    return arrays, header["meta"]


def share(arrays: Mapping[str, np.ndarray], meta: Any) -> list[tuple[dict[str, np.ndarray], Any]]:
    """Every process's (arrays, meta), in process order."""
    if not active():
        return [(dict(arrays), meta)]
    return [unpack(p) for p in gather_bytes(pack(arrays, meta))]


def spread(keys: Sequence[str], costs: Sequence[float], compute, encode, decode) -> dict[str, Any]:
    """compute(key, device) for every key, each on the device `owners` gives it (every device of every process),
    which is also the default device while it runs.

    One process: each key computed on its owner device, the values as compute returns them. Several: each
    process computes its own keys, and every process receives every key's value, as decode(*encode(value))
    (encode: value -> (arrays, JSON-able meta); decode: (key, arrays, meta) -> value), its own included, so
    every process holds the same bytes.
    """
    import jax

    devices = jax.devices()
    owner = owners(costs, len(devices))
    mine = {}
    for k, key in enumerate(keys):
        device = devices[owner[k]]
        if device.process_index == jax.process_index():
            with jax.default_device(device):
                mine[key] = compute(key, device)
    if not active():
        return {key: mine[key] for key in keys}
    arrays, meta = {}, {}
    for k, key in enumerate(keys):
        if key in mine:
            their_arrays, their_meta = encode(mine[key])
            arrays.update({f"{k}/{name}": array for name, array in their_arrays.items()})
            meta[str(k)] = their_meta
    values = {}
    for their_arrays, their_meta in share(arrays, meta):
        for k, value_meta in their_meta.items():
            prefix = f"{k}/"
            values[keys[int(k)]] = decode(keys[int(k)], {name[len(prefix):]: a for name, a in their_arrays.items()
                                                        if name.startswith(prefix)}, value_meta)
    return {key: values[key] for key in keys}
