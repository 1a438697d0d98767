"""One split of a Hub dataset as calibration text, read lazily: its files fetched one by one as reading reaches
them, one column of each read a batch of rows at a time (parquet through pyarrow; JSON, JSON Lines, CSV/TSV and
text lines, plain or compressed as .gz, .bz2 or .xz), each value made text: a string as it is, a conversation
through the model's chat template."""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import io
import itertools
import json
import lzma
import zlib
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from qconvert.calibration import chat
from qconvert.calibration.data_files import READERS, SplitFiles, data_extension, split_files
from qconvert.calibration.hub_dataset import DatasetSelection, Snapshot, one_line, open_snapshot, parse_address
from qconvert.formats.errors import InvalidCheckpointError, UsageError
from qconvert.formats.safetensors_io import sha256_file

DEFAULT_SPLIT = "train"
TEXT_COLUMN = "text"
CHAT_COLUMNS = ("messages", "conversations")
PARQUET_BATCH_ROWS = 64  # rows decoded at a time: the windows rarely need more than a few batches
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
MISSING = object()  # a JSON record without the column


def open_dataset_text(address: str, selection: DatasetSelection, model_folder: Path,
                      drop_prefix: str | None = None) -> DatasetText:
    """The text of a whole Hub dataset (`address` without a file path) as `selection` picks it: the repository
    listed (or its cached snapshot found), the split's files found, the first one read for its columns."""
    parsed = parse_address(address)
    snapshot = open_snapshot(parsed.repo, selection.commit or parsed.revision)
    try:
        split = split_files(snapshot.paths, snapshot.card_metadata(), selection.split or DEFAULT_SPLIT,
                            selection.config, snapshot.where)
    except UsageError as err:  # the messages speak of "the dataset": say which
        raise UsageError(f"--calib {address}: {err}") from None
    return DatasetText(snapshot, split, selection.column, model_folder, drop_prefix)


class DatasetText:
    """The text of one column of one split: iterate it once; then `record()` says what was read."""

    def __init__(self, snapshot: Snapshot, split: SplitFiles, column: str | None, model_folder: Path,
                 drop_prefix: str | None = None):
        """`drop_prefix`: text a rendered conversation loses at its start (the BOS each window already has)."""
        if not split.files:
            raise UsageError(f"split {split.split!r} of Hub dataset {snapshot.repo} has no "
                             f"{'/'.join(e for e, r in READERS.items() if r == split.reader)} file{snapshot.where}")
        self.snapshot, self.split, self.model_folder, self.drop_prefix = snapshot, split, model_folder, drop_prefix
        self.files_read: list[dict[str, str]] = []
        self._first = self._fetch(split.files[0])
        found = columns(self._first, split.reader)
        self.column = column if column is not None else _chosen_column(found, self._name_of_split())
        if self.column not in found:
            raise UsageError(f"{self._name_of_split()} has no column {self.column!r}; its columns: "
                             f"{', '.join(found) or 'none'}")
        self._template: chat.ChatTemplate | None = None
        self._dropped = False  # whether a conversation began with drop_prefix and lost it

    def _name_of_split(self) -> str:
        config = "" if self.split.config == "default" else f" (config {self.split.config})"
        return f"split {self.split.split!r} of Hub dataset {self.snapshot.repo}{config}"

    def _fetch(self, path: str) -> DataFile:
        local = self.snapshot.fetch(path)
        self.files_read.append({"path": path, "sha256": sha256_file(local)})
        return DataFile(local, path, self.snapshot.repo)

    def __iter__(self) -> Iterator[str]:
        row = 0
        for k, path in enumerate(self.split.files):
            file = self._first if k == 0 else self._fetch(path)
            for value in values(file, self.split.reader, self.column):
                yield self._text(value, f"row {row} of {self._name_of_split()} (in {path})")
                row += 1

    def _text(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            return value
        if value is MISSING:
            raise UsageError(f"{where} has no {self.column!r} field")
        if not isinstance(value, list):
            kind = "null" if value is None else type(value).__name__
            raise UsageError(f"{where}: column {self.column!r} holds {kind}, not text or a conversation")
        if self._template is None:
            self._template = chat.load_chat_template(self.model_folder)
            if self._template is None:
                raise UsageError(f"column {self.column!r} of {self._name_of_split()} holds conversations, and the "
                                 "model has no chat template (chat_template.jinja, or chat_template in "
                                 "tokenizer_config.json) to write them as text; pass --calib-column with a text column")
        text = _rendered(self._template, chat.conversation(value, where), where)
        if self.drop_prefix and text.startswith(self.drop_prefix):
            text, self._dropped = text[len(self.drop_prefix):], True
        return text

    @property
    def description(self) -> str:
        """What the text is, in words, for progress lines and the model card."""
        templated = ", written with the model's chat template" if self._template is not None else ""
        config = "" if self.split.config == "default" else f" config {self.split.config},"
        return (f"Hub dataset {self.snapshot.repo} at {self.snapshot.commit[:12]},{config} split {self.split.split}, "
                f"column {self.column}{templated}")

    def record(self) -> dict[str, Any]:
        """qconvert.json's `dataset` entry: what was read, enough to read it again byte for byte."""
        template = None
        if self._template is not None:
            template = {**self._template.record(), "dropped_prefix": self.drop_prefix if self._dropped else None}
        return {"repo": self.snapshot.repo, "revision": self.snapshot.commit, "config": self.split.config,
                "split": self.split.split, "column": self.column, "files": list(self.files_read),
                "chat_template": template}


def _chosen_column(found: list[str], split: str) -> str:
    for column in (TEXT_COLUMN, *CHAT_COLUMNS):
        if column in found:
            return column
    raise UsageError(f"{split} has no {TEXT_COLUMN!r}, {' or '.join(map(repr, CHAT_COLUMNS))} column; its columns: "
                     f"{', '.join(found) or 'none'} (pass one to --calib-column)")


def _rendered(template: chat.ChatTemplate, messages: list[dict[str, Any]], where: str) -> str:
    import jinja2

    try:
        return template.render(messages)
    except jinja2.exceptions.SecurityError as err:
        raise InvalidCheckpointError(f"the model's chat template ({template.source}) did what jinja2's sandbox "
                                     f"forbids ({one_line(err)}); fix the template") from None
    except Exception as err:  # noqa: BLE001 - the template is the checkpoint's code: any error is about this row
        raise UsageError(f"the model's chat template ({template.source}) cannot write {where}: "
                         f"{one_line(err)}") from None


@dataclasses.dataclass(frozen=True)
class DataFile:
    """A dataset file on disk and the path it has in its repository (whose suffixes say how to read it)."""

    local: Path
    path: str
    repo: str

    @property
    def name(self) -> str:
        return f"{self.path} of Hub dataset {self.repo}"

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
    for record in _json_records(file):
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
        for record in _json_records(file):
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


def _json_records(file: DataFile) -> Iterator[dict[str, Any]]:
    """A JSON file's records: a JSON array of objects, or one object per line (JSON Lines, whatever the name)."""
    with _FileErrors(file), _text_stream(file) as stream:
        leading = []  # the lines up to the first that is not blank: its first character tells the form
        for line in stream:
            leading.append(line)
            if line.strip():
                break
        if "".join(leading).lstrip().startswith("["):
            try:
                records = json.loads("".join(leading) + stream.read())
            except json.JSONDecodeError as err:
                raise UsageError(f"{file.name} is not JSON ({err.msg} at line {err.lineno}); write a list of "
                                 "objects, or one object per line") from None
            for k, record in enumerate(records):
                if not isinstance(record, dict):
                    raise UsageError(f"{file.name} item {k} is {type(record).__name__}, not an object")
                yield record
            return
        for lineno, line in enumerate(itertools.chain(leading, stream), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{file.name} line {lineno} is not JSON ({err.msg}); write a list of objects, or "
                                 "one object per line") from None
            if not isinstance(record, dict):
                raise UsageError(f"{file.name} line {lineno} is {type(record).__name__}, not an object")
            yield record
