"""qconvert.json, the conversion record: its typed fields, writing it, reading it back, checking its hashes.

The record is written last into OUT and lists the sha256 of every other output
file, so a folder can be checked against it byte for byte. It is the one
module that writes and reads the file: the pipeline builds a ConversionRecord,
verify, inspect and the card read one, and nobody handles the JSON object.
The records of the stages (calibration, scale search, rounding, weight-only
choice) are kept as the objects their own modules build.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

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


# 2: the smoothing record carries each group's exact scales (`smoothing.scales`), and the alpha search's
# recorded errors come from the exact int8 rounding (formats/quotient.int8_round; they moved in their fourth
# digit, no chosen alpha did). A record without the field is 1.
RECORD_FORMAT_VERSION = 2
# How a vector of scales is written: its float32 values, little-endian, in base64 (exact, and a quarter the size
# of decimal text).
SCALES_ENCODING = "float32-le-base64"


def encode_scales(values: np.ndarray) -> str:
    return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode("ascii")


def decode_scales(text: Any) -> np.ndarray | None:
    """The float32 vector `encode_scales` wrote; None for anything else."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None
    return np.frombuffer(raw, "<f4").astype(np.float32) if len(raw) % 4 == 0 else None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _object_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _number(value: Any, default, kind):
    """`value` as `kind` (int or float) when it is a JSON number, else `default`."""
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


@dataclasses.dataclass(frozen=True)
class SourceRecord:
    """Where the conversion read from: a Hub id or folder, its revision and commit, and each input's sha256."""

    model: str | None = None        # a Hub id; for a local folder, its name only (no path is published)
    is_hub: bool = False
    revision: str | None = None
    commit: str | None = None
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    # A local folder: where it lies from OUT (e.g. "../llama"), so that verify finds it from anywhere.
    folder_from_out: str | None = None
    # A quantized source read as float (e.g. "fp8-block-128x128"); None for a float source.
    format: str | None = None

    @property
    def pinned_revision(self) -> str | None:
        """The commit the source was read at (its revision when no commit is recorded)."""
        return self.commit or self.revision

    def to_json(self) -> dict[str, Any]:
        out = {"model": self.model, "is_hub": self.is_hub, "revision": self.revision, "commit": self.commit,
               "files": dict(sorted(self.files.items()))}
        return _with_present(out, folder_from_out=self.folder_from_out, format=self.format)

    @classmethod
    def from_json(cls, raw: Any) -> "SourceRecord":
        raw = _object(raw)
        files = raw.get("files")
        where, fmt = raw.get("folder_from_out"), raw.get("format")
        return cls(raw.get("model"), raw.get("is_hub") is True, raw.get("revision"), raw.get("commit"),
                   {k: v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {},
                   where if isinstance(where, str) else None, fmt if isinstance(fmt, str) else None)


@dataclasses.dataclass(frozen=True)
class RecordedScales:
    """One smoothing group's exact scales: its source divides its rows (a norm: its gain) by `source_scales`
    (from row `source_offset` on); each linear it feeds multiplies its input columns by `input_scales`."""

    source_scales: np.ndarray
    input_scales: np.ndarray
    source_offset: int = 0
    norm_offset: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source_scales": encode_scales(self.source_scales)}
        # Written once when the consumers multiply by exactly what the source divides by.
        if not (len(self.input_scales) == len(self.source_scales)
                and np.array_equal(self.input_scales, self.source_scales)):
            out["input_scales"] = encode_scales(self.input_scales)
        if self.source_offset:
            out["source_offset"] = self.source_offset
        if self.norm_offset:
            out["norm_offset"] = self.norm_offset
        return out

    @classmethod
    def from_json(cls, raw: Any) -> "RecordedScales | None":
        raw = _object(raw)
        source_scales = decode_scales(raw.get("source_scales"))
        input_scales = decode_scales(raw.get("input_scales", raw.get("source_scales")))
        if source_scales is None or input_scales is None:
            return None
        return cls(source_scales, input_scales, _number(raw.get("source_offset"), 0, int),
                   _number(raw.get("norm_offset"), 0.0, float))


@dataclasses.dataclass(frozen=True)
class SmoothingRecord:
    """SmoothQuant as it was applied: how alpha was chosen, each group's alpha and linears, and exact scales."""

    alpha_mode: str
    family_default_alpha: float | None
    min_scale: float | None
    remedy: str
    alpha: dict[str, float]
    groups: dict[str, tuple[str, ...]]  # source -> the linears it feeds
    scales: dict[str, RecordedScales]  # source -> its exact scales (empty in a format-1 record)
    alpha_search: dict[str, dict[str, float]] | None = None
    method: str = "smoothquant"

    @property
    def unscaled(self) -> list[str]:
        """Group sources recorded without their scales (a record written before format 2)."""
        return sorted(set(self.groups) - set(self.scales))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method, "alpha_mode": self.alpha_mode,
            "family_default_alpha": self.family_default_alpha, "min_scale": self.min_scale,
            "remedy": self.remedy, "alpha": dict(self.alpha),
            "groups": {source: list(linears) for source, linears in self.groups.items()}}
        if self.alpha_search:
            out["alpha_search"] = self.alpha_search
        if self.scales:
            out["encoding"] = SCALES_ENCODING
            out["scales"] = {source: g.to_json() for source, g in self.scales.items()}
        return out

    @classmethod
    def from_json(cls, raw: Any) -> "SmoothingRecord | None":
        if not isinstance(raw, dict):
            return None
        groups = {source: tuple(str(m) for m in linears) for source, linears in _object(raw.get("groups")).items()
                  if isinstance(linears, list)}
        written = _object(raw.get("scales")) if raw.get("encoding") == SCALES_ENCODING else {}
        scales = {source: RecordedScales.from_json(written.get(source)) for source in groups}
        alpha = _object(raw.get("alpha"))
        return cls(str(raw.get("alpha_mode", "")), raw.get("family_default_alpha"), raw.get("min_scale"),
                   str(raw.get("remedy", "")), {k: v for k, v in alpha.items() if isinstance(v, (int, float))},
                   groups, {s: g for s, g in scales.items() if g is not None}, raw.get("alpha_search"),
                   str(raw.get("method", "smoothquant")))


@dataclasses.dataclass(frozen=True)
class ConversionRecord:
    """qconvert.json, typed: what was converted, how, and the sha256 of every output file.

    The records of the stages (calibration, scale_search, rounding, weight_only)
    are the JSON objects their own modules build; the rest is typed here.
    `to_json` writes the keys in the order qconvert has always written them.
    """

    scheme: str | None
    files: dict[str, str]
    source: SourceRecord = SourceRecord()
    qconvert_version: str | None = None
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    smoothing: SmoothingRecord | None = None
    scale_search: dict[str, Any] | None = None
    rounding: dict[str, Any] | None = None
    weight_only: dict[str, Any] | None = None
    format_version: int = RECORD_FORMAT_VERSION
    kv_cache: dict[str, Any] | None = None  # the KV cache's scales (--kv-cache): scheme, rule, calibrated maxima

    @property
    def source_model(self) -> str | None:
        return self.source.model

    @property
    def source_revision(self) -> str | None:
        return self.source.pinned_revision

    @property
    def act(self) -> str:
        """The activation mode the flags record ("dynamic" when they name none)."""
        return str(self.flags.get("act", "dynamic"))

    def to_json(self) -> dict[str, Any]:
        out = {"format_version": self.format_version, "qconvert_version": self.qconvert_version,
               "source": self.source.to_json(), "scheme": self.scheme, "flags": self.flags,
               "calibration": self.calibration,
               "smoothing": self.smoothing.to_json() if self.smoothing is not None else None,
               "scale_search": self.scale_search, "files": dict(sorted(self.files.items())),
               "rounding": self.rounding}
        return _with_present(out, weight_only=self.weight_only, kv_cache=self.kv_cache)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "ConversionRecord":
        """The typed record of a parsed qconvert.json (its `files` map already checked); fields of the wrong
        type read as absent, for the integrity checks to report."""
        scheme, version = raw.get("scheme"), raw.get("format_version", 1)
        return cls(scheme if isinstance(scheme, str) else None, dict(raw["files"]),
                   SourceRecord.from_json(raw.get("source")), raw.get("qconvert_version"),
                   _object(raw.get("flags")), _object_or_none(raw.get("calibration")),
                   SmoothingRecord.from_json(raw.get("smoothing")), _object_or_none(raw.get("scale_search")),
                   _object_or_none(raw.get("rounding")), _object_or_none(raw.get("weight_only")),
                   version if isinstance(version, int) else 1, _object_or_none(raw.get("kv_cache")))


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


def write_record(folder: Path, record: ConversionRecord) -> str:
    """Write `record` as folder/qconvert.json (deterministic bytes, mode 0644); returns its sha256."""
    return write_json(Path(folder) / RECORD_NAME, record.to_json())


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
    return ConversionRecord.from_json(raw)


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


def _with_present(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """`out` with each optional key that has a value (keys written only when present, so older records keep
    their bytes)."""
    out.update({key: value for key, value in optional.items() if value is not None})
    return out
