"""The JSON files of a model folder: one reader that insists on an object, one deterministic writer.

The reader says what went wrong as a `kind` and keeps the original exception,
so each caller can word its own message and pick its own error type.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from qconvert.formats.errors import FormatError

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
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonFileError(path, INVALID, exc) from exc
    if not isinstance(data, dict):
        raise JsonFileError(path, NOT_OBJECT)
    return data


def json_bytes(data: Any) -> bytes:
    """The bytes qconvert writes for a JSON file: 2-space indent, UTF-8 as is, a newline at the end."""
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def write_json(path: Path, data: Any) -> str:
    """Write JSON deterministically (json_bytes), mode 0644; returns its sha256."""
    raw = json_bytes(data)
    Path(path).write_bytes(raw)
    os.chmod(path, 0o644)
    return hashlib.sha256(raw).hexdigest()  # of the bytes just written, not read back
