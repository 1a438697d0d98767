"""The envelope of every JSON document qconvert prints with --json, on success and on failure (docs/JSON.md).

Every command's document opens with the same fields: `format_version` (of this schema), `command`,
`qconvert_version`, `exit_code` (the process's), `error` (the one line printed on stderr, or null) and `out` (the
OUT the command was given, or null where the arguments never parsed); the command's own fields follow.
"""

from __future__ import annotations

import json
from typing import Any

from qconvert.formats import outside

# 2: one envelope for every command (verify's record was version 1 alone, with "folder" where it has "out").
FORMAT_VERSION = 2


def envelope(command: str, version: str, *, exit_code: int, out: str | None,
             error: str | None = None) -> dict[str, Any]:
    """The fields every document opens with (`version`: qconvert's, which the layers above this one know)."""
    return {"format_version": FORMAT_VERSION, "command": command, "qconvert_version": version,
            "exit_code": int(exit_code), "error": error, "out": out}


def error_document(command: str, version: str, message: str, exit_code: int, out: str | None) -> dict[str, Any]:
    """The document of a run that failed before it had a result: its line and exit code. verify's says
    `"passed": false` and an ERROR verdict, as its report would."""
    document = envelope(command, version, exit_code=exit_code, out=out, error=message)
    if command == "verify":
        document.update(passed=False, verdict=f"ERROR {out}: {message}" if out else f"ERROR {message}")
    return document


def dumps(document: dict[str, Any]) -> str:
    """The document as printed: indented, keys in a fixed order (the envelope first)."""
    return json.dumps(outside.finite_json(document), indent=2, allow_nan=False)
