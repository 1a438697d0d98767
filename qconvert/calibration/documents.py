"""Every text `--calib` source as documents: the built-in corpus (and verify's held-out prose), a .txt or .jsonl
file (local, or one file of a Hub dataset), and one column of one split of a whole Hub dataset.

A whole dataset is read lazily: its files fetched one by one as reading reaches them, each value made text (a
string as it is, a conversation through the model's chat template).
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator

from qconvert.calibration import chat
from qconvert.calibration.data_files import READERS, SplitFiles, split_files
from qconvert.calibration.hub_dataset import (DatasetSelection, Snapshot, download_dataset_file, is_whole_dataset,
                                              one_line, open_snapshot, parse_address)
from qconvert.calibration.rows import MISSING, TEXT_COLUMN, DataFile, columns, json_records, values
from qconvert.formats.errors import InvalidCheckpointError, UsageError
from qconvert.formats.safetensors_io import sha256_file

BUILTIN = "builtin"
RANDOM = "random"
# verify's held-out prose: shipped beside the calibration corpus, never used to calibrate.
HELD_OUT = "held-out"
DEFAULT_SPLIT = "train"
CHAT_COLUMNS = ("messages", "conversations")


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of the built-in text or of a file (a .txt file as its path: read as far as needed), what
    they are, and the sha256 of the file they come from (None: built in)."""

    texts: Iterable[str] | Path
    description: str
    sha256: str | None = None

    def record(self) -> None:
        """No `dataset` entry: the source and the sha256 say what was read."""
        return None


def builtin_corpus_text() -> str:
    """The English prose shipped inside the package: the offline default calibration text."""
    return resources.files("qconvert").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def held_out_text() -> str:
    """English prose shipped for evaluation only: text no calibration reads unless given it as a file."""
    return resources.files("qconvert").joinpath("data/evaluation.txt").read_text(encoding="utf-8")


def open_documents(calib: str, selection: DatasetSelection, model_folder: Path,
                   drop_prefix: str | None = None) -> Documents | DatasetText:
    """The documents of a text --calib (builtin | held-out | FILE.txt | FILE.jsonl | hf://datasets/... file or
    whole dataset); `selection` picks a whole dataset's config, split and column, and `drop_prefix` is the text
    its rendered conversations lose at their start (the BOS each window already has)."""
    if calib == BUILTIN:
        return Documents([builtin_corpus_text()], "qconvert's built-in English prose corpus")
    if calib == HELD_OUT:
        return Documents([held_out_text()], "qconvert's built-in held-out English prose (never calibrated on)")
    if is_whole_dataset(calib):
        return open_dataset_text(calib, selection, model_folder, drop_prefix)
    local = download_dataset_file(calib) if calib.startswith("hf://") else Path(calib)
    check_text_file(local)
    texts = local if local.suffix.lower() == ".txt" else _jsonl_texts(local)
    description = f"Hub dataset file {calib}" if calib.startswith("hf://") else f"local file {local.name}"
    return Documents(texts, description, sha256_file(local))


def is_local_file(calib: str) -> bool:
    """Whether a --calib source names a local file (not built-in text, random ids or a Hub address)."""
    return calib not in (BUILTIN, RANDOM, HELD_OUT) and not calib.startswith("hf://")


def check_text_file(path: Path) -> None:
    """UsageError unless `path` is a .txt or .jsonl file."""
    if not path.is_file():
        raise UsageError(f"calibration file {path} does not exist; pass a .txt or .jsonl file, "
                         f"'{BUILTIN}' or '{RANDOM}' to --calib")
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise UsageError(f"calibration file {path} must end in .txt or .jsonl")


def _jsonl_texts(path: Path) -> Iterator[str]:
    """Each record's "text" field of a .jsonl file, read a line at a time."""
    for where, record in json_records(DataFile(path, path.name, f"calibration file {path}")):
        if not isinstance(record.get("text"), str):
            raise UsageError(f"{path} {where} has no string \"text\" field; "
                             "each line must be an object with a \"text\" field")
        yield record["text"]


def check_calibration_source(calib: str | None, dataset: DatasetSelection | None = None) -> None:
    """UsageError for a --calib that calibration may not read: verify's held-out text (calibrating on it would
    leave verify nothing held out, while qconvert.json said it was never calibrated on); or dataset flags
    without a whole dataset to apply to."""
    if calib == HELD_OUT:
        raise UsageError(f"--calib {HELD_OUT} is verify's evaluation text, kept out of calibration so that verify "
                         f"measures on text the conversion never saw; calibrate on '{BUILTIN}' (the default), a "
                         "file or a dataset")
    check_dataset_flags(calib, dataset)


def check_dataset_flags(calib: str | None, dataset: DatasetSelection | None) -> None:
    """UsageError for --calib-config/-split/-column given where --calib is not a whole Hub dataset."""
    given = dataset.given() if dataset is not None else []
    for field, flag in DatasetSelection.FLAGS:
        if flag in given and not str(getattr(dataset, field)).strip():
            raise UsageError(f"{flag} is empty; name the {field} to read")
    if given and not is_whole_dataset(calib):
        raise UsageError(f"{', '.join(given)} choose{'s' if len(given) == 1 else ''} from a whole Hub dataset "
                         f"(--calib hf://datasets/OWNER/NAME), not from --calib {calib or BUILTIN}")


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
    """The text of one column of one split: iterate `texts` once; then `record()` says what was read."""

    sha256 = None  # the files read are in the record, each with its own

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
        return DataFile(local, path, f"{path} of Hub dataset {self.snapshot.repo}")

    @property
    def texts(self) -> Iterator[str]:
        """The column's rows as text, in order, each file fetched when reading reaches it."""
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
