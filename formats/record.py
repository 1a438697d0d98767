"""qconvert.json, the conversion record: its name, writing it, reading it back, and checking the hashes it holds.

The record is written last into OUT and lists the sha256 of every other output
file, so a folder can be checked against it byte for byte. What goes into it
(source, flags, calibration) is the pipeline's business; this module owns the
file itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from qconvert.formats.errors import FormatError
from qconvert.formats.jsonfile import NOT_OBJECT, JsonFileError, read_json_object, write_json
from qconvert.formats.safetensors_io import sha256_file

RECORD_NAME = "qconvert.json"

# Why a record could not be read (RecordError.kind), for the caller to word.
NO_RECORD = "missing"
UNREADABLE = "unreadable"  # not readable, not UTF-8 or not JSON
NO_FILES = "no files map"  # not an object, or no {"name": "sha256"} "files" map


class RecordError(FormatError):
    """qconvert.json is missing or malformed; `kind` says how, `cause` holds the underlying error if any."""

    def __init__(self, path: Path, kind: str, cause: BaseException | None = None):
        self.path, self.kind, self.cause = Path(path), kind, cause
        super().__init__(f"{path}: {kind}" + (f" ({cause})" if cause is not None else ""))


@dataclasses.dataclass(frozen=True)
class ConversionRecord:
    """qconvert.json as read back: the raw object, and the parts that readers rely on."""

    raw: dict[str, Any]
    scheme: str | None  # None when the record names none
    files: dict[str, str]  # output file (relative path) -> sha256
    source_model: str | None
    source_revision: str | None


@dataclasses.dataclass(frozen=True)
class FileCheck:
    """One recorded output file against its recorded sha256."""

    name: str
    expected: str
    actual: str | None  # None: missing, or a path outside the folder (never read)
    outside: bool = False  # the record names a path outside the folder

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


def write_record(folder: Path, record: dict[str, Any]) -> str:
    """Write `record` as folder/qconvert.json (deterministic bytes, mode 0644); returns its sha256."""
    return write_json(Path(folder) / RECORD_NAME, record)


def read_record(folder: Path) -> ConversionRecord:
    """folder/qconvert.json; RecordError (kind NO_RECORD, UNREADABLE or NO_FILES) when it cannot be used."""
    path = Path(folder) / RECORD_NAME
    if not path.is_file():
        raise RecordError(path, NO_RECORD)
    try:
        raw = read_json_object(path)
    except JsonFileError as exc:
        if exc.kind == NOT_OBJECT:
            raise RecordError(path, NO_FILES) from exc
        raise RecordError(path, UNREADABLE, exc.cause) from exc
    files = raw.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise RecordError(path, NO_FILES)
    scheme = raw.get("scheme")
    source = raw.get("source") if isinstance(raw.get("source"), dict) else {}
    return ConversionRecord(raw=raw, scheme=scheme if isinstance(scheme, str) else None, files=dict(files),
                            source_model=source.get("model"),
                            source_revision=source.get("commit") or source.get("revision"))


def check_hashes(folder: Path, record: ConversionRecord) -> list[FileCheck]:
    """Every recorded file hashed and compared, in name order; a path outside the folder is never read."""
    folder = Path(folder)
    checks = []
    for name in sorted(record.files):
        expected = record.files[name]
        if Path(name).is_absolute() or ".." in Path(name).parts:
            checks.append(FileCheck(name, expected, None, outside=True))
        else:
            path = folder / name
            checks.append(FileCheck(name, expected, sha256_file(path) if path.is_file() else None))
    return checks
