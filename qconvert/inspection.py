"""What a quantized folder holds: scheme, each tensor's kind/shape/bytes, totals, and whether the file hashes still match."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from qconvert.formats.errors import FormatError, InvalidCheckpointError, require_converted_folder
from qconvert.formats.layouts import open_quantized
from qconvert.formats.record import (
    NO_FILES, NO_RECORD, RECORD_NAME, ConversionRecord, FileCheck, RecordError, check_hashes, read_record,
)
from qconvert.formats.kv_cache import KV_SCALE_KIND, is_kv_scale
from qconvert.plan import UNCHANGED
from qconvert.schemes import scheme_named


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """A quantized linear (kind = scheme) or a tensor stored as the source held it (kind = UNCHANGED)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str  # as stored: a quantized linear's codes and the word they are packed in ("int4 in int32")
    stored_bytes: int
    float_dtype: str  # the dtype it stands for: a quantized linear's float dtype, else `dtype`

    @property
    def float_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.float_dtype).itemsize


@dataclasses.dataclass(frozen=True)
class InspectReport:
    """The contents of a quantized folder."""

    folder: Path
    scheme: str
    tensors: tuple[TensorRow, ...]
    files: tuple[FileCheck, ...]
    record: ConversionRecord | None  # qconvert.json; None when the folder has none
    servers: dict[str, str] = dataclasses.field(default_factory=dict)  # server -> yes, no or not measured

    @property
    def stored_bytes(self) -> int:
        return sum(t.stored_bytes for t in self.tensors)

    @property
    def float_bytes(self) -> int:
        return sum(t.float_bytes for t in self.tensors)

    @property
    def compression_ratio(self) -> float:
        return self.float_bytes / self.stored_bytes if self.stored_bytes else 0.0

    @property
    def hashes_ok(self) -> bool | None:
        """True if every recorded hash matches, False if one does not, None without qconvert.json."""
        if self.record is None:
            return None
        return all(f.ok for f in self.files)

    def source_summary(self) -> dict[str, Any] | None:
        """What the folder was converted from, as quantize --json names it (None without qconvert.json)."""
        if self.record is None:
            return None
        source = self.record.source
        return {"model": source.model, "is_hub": source.is_hub, "revision": source.revision,
                "commit": source.commit, "format": source.format}

    @property
    def quantized_count(self) -> int:
        """The quantized linears (neither tensors kept as they were nor the KV cache's scales)."""
        return sum(t.kind not in (UNCHANGED, KV_SCALE_KIND) for t in self.tensors)

    @property
    def kv_scale_count(self) -> int:
        return sum(t.kind == KV_SCALE_KIND for t in self.tensors)

    def summary(self) -> dict[str, Any]:
        """The machine-readable form `inspect --json` prints."""
        return {
            "out": str(self.folder), "scheme": self.scheme,
            "quantized_modules": self.quantized_count,
            "unchanged_tensors": sum(t.kind == UNCHANGED for t in self.tensors),
            "output_bytes": self.stored_bytes, "float_bytes": self.float_bytes,
            "compression_ratio": round(self.compression_ratio, 4), "hashes_ok": self.hashes_ok,
            "servers": dict(self.servers), "source": self.source_summary(),
            "files": [{"name": f.name, "expected": f.expected, "actual": f.actual, "ok": f.ok} for f in self.files],
            "tensors": [{"name": t.name, "kind": t.kind, "shape": list(t.shape), "dtype": t.dtype,
                         "float_dtype": t.float_dtype, "output_bytes": t.stored_bytes} for t in self.tensors],
        }


def inspect_checkpoint(folder) -> InspectReport:
    """Read a folder that `qconvert quantize` wrote (or any folder in one of its layouts)."""
    folder = Path(folder)
    require_converted_folder(folder)
    try:
        qc = open_quantized(folder)
        try:
            rows = _tensor_rows(qc)
        finally:
            qc.close()
    except FormatError as err:
        raise InvalidCheckpointError(str(err)) from None
    record = _read_record(folder)
    checks = tuple(check_hashes(folder, record)) if record is not None else ()
    return InspectReport(folder=folder, scheme=qc.scheme, tensors=tuple(rows), files=checks,
                         record=record,
                         servers=scheme_named(qc.scheme).servers(qc.flags, qc.config,
                                                                 kv_cache=any(t.kind == KV_SCALE_KIND for t in rows)))


def _tensor_rows(qc) -> list[TensorRow]:
    ckpt = qc.checkpoint
    rows = []
    for module in qc.quantized_modules:
        q = qc.qarray(module)
        parts = qc.layout.part_names(module, ckpt)
        # The codes are the largest part (the scales and absmax are a small fraction of it).
        container = ckpt.dtype(max(parts, key=ckpt.nbytes)).name
        codes = code_dtype(q)
        stored = codes if codes == container else f"{codes} in {container}"
        if q.zero_point is not None and q.kind.levels is not None:  # NVFP4: the slot holds the tensor's global scale
            stored += " + global scale"
        elif q.zero_point is not None:  # asymmetric: each group's zero point is stored beside its scale
            stored += " + zero points"
        rows.append(TensorRow(module, qc.scheme, q.shape, stored, sum(ckpt.nbytes(n) for n in parts),
                              float_dtype=q.dtype))
    for name in qc.float_names:
        dtype = ckpt.dtype(name).name
        kind = KV_SCALE_KIND if is_kv_scale(name) else UNCHANGED
        rows.append(TensorRow(name, kind, ckpt.shape(name), dtype, ckpt.nbytes(name), float_dtype=dtype))
    return sorted(rows, key=lambda r: r.name)


def code_dtype(q) -> str:
    """The type of a QArray's codes in words: int8, int4, nf4 (4-bit indices into its table), float8_e4m3fn."""
    if q.kind.float_codes:
        return np.dtype(q.qvalue.dtype).name
    if q.kind.levels is not None:
        return str(q.kind)
    return f"int{q.kind.bits}"


def _read_record(folder: Path) -> ConversionRecord | None:
    """qconvert.json, None when the folder has none (any folder in one of the layouts can be inspected)."""
    try:
        record = read_record(folder)
    except RecordError as err:
        if err.kind == NO_RECORD:
            return None
        if err.kind == NO_FILES:
            raise InvalidCheckpointError(f"{err.path} has no files map; it was not written by qconvert") from None
        if isinstance(err.cause, OSError):
            raise err.cause from None
        raise InvalidCheckpointError(f"{err.path} is not valid JSON ({err.cause})") from None
    if not record.files:
        # Without the map there is nothing to check: "all 0 files match" would pass vacuously.
        raise InvalidCheckpointError(f"{folder / RECORD_NAME} has no files map; it was not written by qconvert")
    return record
