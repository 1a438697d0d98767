"""The JSON files of a model folder: one reader that insists on an object, the config.json reader, one writer.

`read_json_object` says what went wrong as a `kind` and keeps the original
exception, so each caller can word its own message and pick its own error type;
`read_config` is the one reader of a folder's config.json, which every layer
(the pipeline, the loader, the tokenizer, the layouts, verify) asks.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from qconvert.formats import outside
from qconvert.formats.errors import FormatError, InvalidCheckpointError

MISSING = "missing"  # no such file
UNREADABLE = "unreadable"  # the file exists but cannot be read (permissions, a folder, I/O)
INVALID = "invalid"  # not UTF-8 or not JSON
NOT_OBJECT = "not an object"  # valid JSON, but not a {...}


class JsonFileError(FormatError):
    """A JSON file that could not be read as an object; `kind` is one of the four above, `cause` the original error."""

    def __init__(self, path: Path, kind: str, cause: BaseException | None = None):
        self.path, self.kind, self.cause = Path(path), kind, cause
        detail = f" ({cause})" if cause is not None and kind != MISSING else ""
        super().__init__(f"{path}: {kind}{detail}")


def read_json_object(path) -> dict[str, Any]:
    """The JSON object in the file at `path`; JsonFileError saying why when there is none."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise JsonFileError(path, MISSING, exc) from exc
    except UnicodeDecodeError as exc:
        raise JsonFileError(path, INVALID, exc) from exc
    except OSError as exc:
        raise JsonFileError(path, UNREADABLE, exc) from exc
    try:
        data = json.loads(text, parse_constant=outside.json_constant)
    except (json.JSONDecodeError, outside.OutsideValueError) as exc:
        raise JsonFileError(path, INVALID, exc) from exc
    if not isinstance(data, dict):
        raise JsonFileError(path, NOT_OBJECT)
    return data


CONFIG_NAME = "config.json"


def read_config(folder, *, missing: str | None = "a Hugging Face checkpoint folder needs its config.json",
                broken: str = "restore the file from the model's source") -> dict[str, Any]:
    """folder/config.json as a dict; InvalidCheckpointError, one line, when there is none to read.

    `missing` ends the message of an absent config.json (None: it is optional,
    and the result is then {}); `broken` ends the message of one that is not
    valid JSON or not an object: each says what to do, in the caller's words
    (the defaults speak of a source checkpoint). A file that cannot be read at
    all (permissions, I/O) raises the OSError itself.
    """
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        if missing is None:
            return {}
        raise InvalidCheckpointError(f"{path} is missing; {missing}")
    try:
        return read_json_object(path)
    except JsonFileError as err:
        if err.kind == NOT_OBJECT:
            raise InvalidCheckpointError(f"{path} must hold a JSON object; {broken}") from None
        if err.kind != INVALID:
            raise err.cause from None
        raise InvalidCheckpointError(f"{path} is not valid JSON ({err.cause}); {broken}") from None


def json_bytes(data: Any) -> bytes:
    """The bytes qconvert writes for a JSON file: 2-space indent, UTF-8 as is, a newline at the end."""
    return (json.dumps(outside.finite_json(data), indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def write_json(path: Path, data: Any) -> str:
    """Write JSON deterministically (json_bytes), mode 0644; returns its sha256."""
    raw = json_bytes(data)
    Path(path).write_bytes(raw)
    os.chmod(path, 0o644)
    return hashlib.sha256(raw).hexdigest()  # of the bytes just written, not read back
