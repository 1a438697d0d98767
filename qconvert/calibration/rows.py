"""Reading calibration files: a text file's first characters, and one column of a data file a batch of rows at a
time (parquet through pyarrow; JSON, JSON Lines, CSV/TSV and text lines, plain or compressed as .gz, .bz2 or .xz).
Text is UTF-8; a byte that is not is named."""

from __future__ import annotations

import bz2
import codecs
import csv
import dataclasses
import gzip
import io
import itertools
import json
import lzma
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator

from qconvert.calibration.data_files import data_extension
from qconvert.calibration.hub_dataset import one_line
from qconvert.formats.errors import UsageError

TEXT_COLUMN = "text"
PARQUET_BATCH_ROWS = 64  # rows decoded at a time: the windows rarely need more than a few batches
READ_CHUNK_BYTES = 1 << 20
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
MISSING = object()  # a JSON record without the column


def decoded(name: str, data: bytes, offset: int, decoder, final: bool) -> str:
    """`data` (the bytes at `offset` of the file `name` names) through an incremental UTF-8 decoder; UsageError
    naming the first byte that is not UTF-8."""
    pending = len(decoder.getstate()[0])
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as err:
        start = offset - pending + err.start
        raise UsageError(f"{name} is not UTF-8 text (byte {start}: "
                         f"{err.object[err.start:err.start + 1]!r}); convert it to UTF-8") from None


def read_text_prefix(path: Path, chars: int) -> tuple[str, bool]:
    """The first `chars` characters of a UTF-8 file (or all of it), and whether that is all of it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts, have, offset = [], 0, 0
    with open(path, "rb") as f:
        while have <= chars:
            data = f.read(READ_CHUNK_BYTES)
            text = decoded(f"calibration file {path}", data, offset, decoder, final=not data)
            offset += len(data)
            parts.append(text)
            have += len(text)
            if not data:
                return "".join(parts), True
    text = "".join(parts)
    return text[:chars], False


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A data file on disk, the path it has in its repository or folder (whose suffixes say how to read it), and
    its name in messages."""

    local: Path
    path: str
    name: str  # in messages: "PATH of Hub dataset REPO", "calibration file PATH"

    @property
    def suffixes(self) -> list[str]:
        return [suffix.lower() for suffix in PurePosixPath(self.path).suffixes]


def _binary(file: DataFile):
    """The file's bytes, decompressed as its name says (.gz, .bz2, .xz); UsageError for another compression."""
    data = data_extension(file.path)
    after = file.suffixes[file.suffixes.index(data) + 1:] if data in file.suffixes else []
    if not after:
        return open(file.local, "rb")
    if len(after) == 1 and after[0] in COMPRESSIONS:
        return COMPRESSIONS[after[0]](file.local, "rb")
    raise UsageError(f"{file.name} is compressed as {''.join(after)}; qconvert reads .gz, .bz2 and .xz ones")


def _text_stream(file: DataFile) -> io.TextIOWrapper:
    # utf-8-sig: a byte order mark at the start is no part of the first record or header.
    return io.TextIOWrapper(_binary(file), encoding="utf-8-sig", newline="")


def columns(file: DataFile, reader: str) -> list[str]:
    """The column names of a data file (of a JSON file, its first record's keys)."""
    if reader == "parquet":
        return list(_parquet(file).schema_arrow.names)
    if reader == "text":
        return [TEXT_COLUMN]
    if reader == "csv":
        with _FileErrors(file), _text_stream(file) as stream:
            return list(csv.DictReader(stream, delimiter=_delimiter(file)).fieldnames or [])
    for _, record in json_records(file):
        return list(record)
    return []


def values(file: DataFile, reader: str, column: str) -> Iterator[Any]:
    """The column's value in each row of a data file, in order, a batch at a time (MISSING where a JSON record
    lacks it)."""
    if reader == "parquet":
        with _FileErrors(file):
            for batch in _parquet(file).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[column]):
                yield from batch.column(0).to_pylist()
    elif reader == "text":
        with _FileErrors(file), _text_stream(file) as stream:
            for line in stream:
                yield from line.splitlines()
    elif reader == "csv":
        csv.field_size_limit(max(csv.field_size_limit(), (1 << 31) - 1))  # a document per cell: no 128 KB cap
        with _FileErrors(file), _text_stream(file) as stream:
            for row in csv.DictReader(stream, delimiter=_delimiter(file)):
                yield row.get(column, MISSING)
    else:
        for _, record in json_records(file):
            yield record.get(column, MISSING)


def _delimiter(file: DataFile) -> str:
    return "\t" if ".tsv" in file.suffixes else ","


class _FileErrors:
    """Reading errors of a data file (not UTF-8, a damaged parquet, CSV or archive) as one UsageError naming it."""

    def __init__(self, file: DataFile):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, kind, err, traceback):
        if err is None or isinstance(err, (UsageError, GeneratorExit)):
            return False
        import pyarrow as pa

        if isinstance(err, UnicodeDecodeError):
            raise UsageError(f"{self.file.name} is not UTF-8 text ({err.reason} at byte {err.start}); convert it "
                             "to UTF-8") from None
        if isinstance(err, (pa.ArrowException, csv.Error, OSError, EOFError, lzma.LZMAError, zlib.error)):
            raise UsageError(f"{self.file.name} cannot be read ({one_line(err)}); the dataset file is damaged or "
                             "not what its name says") from None
        return False


def _parquet(file: DataFile):
    import pyarrow.parquet as pq

    if file.suffixes[-1:] != [data_extension(file.path)]:
        raise UsageError(f"{file.name} is a compressed parquet file; parquet compresses inside, so qconvert reads "
                         "it only uncompressed")
    with _FileErrors(file):
        return pq.ParquetFile(file.local)


def json_records(file: DataFile) -> Iterator[tuple[str, dict[str, Any]]]:
    """A JSON file's records, each with where it stands ("line 3", "item 0"): a JSON array of objects, or one
    object per line (JSON Lines, whatever the name), read a line at a time."""
    with _FileErrors(file), _binary(file) as binary:
        lines = _lines(file, binary)
        leading = []  # the lines up to the first that is not blank: its first character tells the form
        for line in lines:
            leading.append(line)
            if line.strip():
                break
        if "".join(leading).lstrip().startswith("["):
            yield from _json_array(file, "".join(itertools.chain(leading, lines)))
            return
        for lineno, line in enumerate(itertools.chain(leading, lines), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{file.name} line {lineno} is not JSON ({err.msg}); write a list of objects, or "
                                 "one object per line") from None
            if not isinstance(record, dict):
                raise UsageError(f"{file.name} line {lineno} is {type(record).__name__}, not an object")
            yield f"line {lineno}", record


def _json_array(file: DataFile, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{file.name} is not JSON ({err.msg} at line {err.lineno}); write a list of objects, or "
                         "one object per line") from None
    for k, record in enumerate(records):
        if not isinstance(record, dict):
            raise UsageError(f"{file.name} item {k} is {type(record).__name__}, not an object")
        yield f"item {k}", record


# The longest line of a calibration file read, in bytes: a record longer than this is no text to calibrate on,
# and reading it whole could take the machine's memory.
MAX_LINE_BYTES = 64 * 2**20


def _lines(file: DataFile, binary: BinaryIO) -> Iterator[str]:
    """The file's lines, each decoded as it is read (a byte order mark at the start is no part of the first);
    UsageError for a line longer than MAX_LINE_BYTES, read no further than that."""
    offset = 0
    for lineno, raw in enumerate(iter(lambda: binary.readline(MAX_LINE_BYTES + 1), b""), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise UsageError(f"{file.name} line {lineno} is longer than {MAX_LINE_BYTES // 2**20} MiB; split it "
                             "into records of text")
        skip = len(codecs.BOM_UTF8) if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else 0
        yield decoded(file.name, raw[skip:], offset + skip, codecs.getincrementaldecoder("utf-8")(), final=True)
        offset += len(raw)
