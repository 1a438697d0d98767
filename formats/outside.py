"""Values from outside qconvert, checked where they enter; `shown`, the one way their text reaches a message.

Outside means what a user, a launcher or a checkpoint hands qconvert: flags, environment variables, paths,
config values, tensor names, the text a chat template renders. Each kind is parsed and bounded here, once, so
a hostile value of that kind (a Unicode digit, a control character, bytes that are not UTF-8, NaN, a number
out of range, an enormous string) fails as a usage error with one line, wherever it would later be used.
Only the standard library is imported: the console entry point and the signal watchdog may use it.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata
from pathlib import Path

# Characters of a shown text at most; longer ones keep their head and tail.
SHOWN_MAX = 600
# A flag's text (a pattern, a revision, a split name, an address) at most, in bytes.
TEXT_MAX_BYTES = 4096
# A path at most, in bytes, and one of its names (Linux's PATH_MAX and NAME_MAX).
PATH_MAX_BYTES = 4096
NAME_MAX_BYTES = 255
# Unicode's line and paragraph separators end a line on some terminals, though they are no control characters.
_LINE_BREAKING = {"\u2028", "\u2029", "\x85"}


class OutsideValueError(ValueError):
    """A value from outside that qconvert refuses; its message says why, without the value's own words."""


def shown(text: object) -> str:
    """`text` as a message may print it: one line of printable characters.

    Control characters, line separators, format characters (bidirectional overrides, zero-width marks) and the
    undecodable bytes of a non-UTF-8 name (Python's surrogate escapes) are written as escapes (\\n, \\x1b,
    \\u202e, \\xff); a very long text keeps its head and tail around an ellipsis.
    """
    text = str(text)
    if len(text) > SHOWN_MAX:
        text = f"{text[:SHOWN_MAX // 2]}...{text[-SHOWN_MAX // 2:]}"
    return "".join(_escaped(ch) for ch in text)


def _escaped(ch: str) -> str:
    if ch.isprintable() and ch not in _LINE_BREAKING:
        return ch
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as os.fsdecode keeps it
        return f"\\x{code - 0xDC00:02x}"
    if ch == " ":
        return ch
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch)
    if named:
        return named
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def refuse(what: str, why: str) -> OutsideValueError:
    return OutsideValueError(f"{what} {why}")


def _check_text(value: str, what: str, *, max_bytes: int = TEXT_MAX_BYTES) -> str:
    """`value` if it is text a message, a file or a request may carry as it is: UTF-8, no control characters,
    bounded; OutsideValueError otherwise."""
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        raise refuse(what, "holds bytes that are not UTF-8")
    bad = next((ch for ch in value if unicodedata.category(ch) in ("Cc", "Cf") or ch in _LINE_BREAKING), None)
    if bad is not None:
        raise refuse(what, f"holds a control character ({_escaped(bad)})")
    if len(value.encode("utf-8")) > max_bytes:
        raise refuse(what, f"is longer than {max_bytes} bytes")
    return value


def text(value: object, what: str, *, empty: bool = False, max_bytes: int = TEXT_MAX_BYTES) -> str:
    """A flag's or a variable's text: UTF-8, no control characters, at most `max_bytes`; not blank unless
    `empty`."""
    value = _check_text(str(value), what, max_bytes=max_bytes)
    if not empty and not value.strip():
        raise refuse(what, "is empty")
    return value


_WHOLE = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def whole_number(value: object, what: str, *, low: int | None = None, high: int | None = None) -> int:
    """An integer written in ASCII digits (not Unicode's other digits), within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise refuse(what, "is not a whole number")
    if isinstance(value, str):
        written = value.strip()
        if not _WHOLE.fullmatch(written) or len(written) > 20:
            raise refuse(what, "is not a whole number written in the digits 0-9")
        value = int(written)
    return _within(value, what, low, high)


def real_number(value: object, what: str, *, low: float | None = None, high: float | None = None) -> float:
    """A finite number written in ASCII (no NaN, no inf, no Unicode digits), within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise refuse(what, "is not a number")
    if isinstance(value, str):
        written = value.strip()
        if not _REAL.fullmatch(written) or len(written) > 64:
            raise refuse(what, "is not a number written in the digits 0-9 (e.g. 0.01)")
        value = float(written)
    if not math.isfinite(value):
        raise refuse(what, "is not a finite number")
    return _within(float(value), what, low, high)


def _within(value, what: str, low, high):
    if low is not None and value < low:
        raise refuse(what, f"is below {low}")
    if high is not None and value > high:
        raise refuse(what, f"is above {high}")
    return value


_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(value: object, what: str) -> int:
    """'5GiB', '500MB', '1000000' -> a positive number of bytes, at most 2**50."""
    match = _SIZE.fullmatch(str(value)) if len(str(value)) <= 64 else None
    if not match:
        raise refuse(what, "is not a size; write e.g. 5GiB, 500MB or a number of bytes")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    return _within(size, what, 1, 2**50)


def path(value: object, what: str) -> Path:
    """A local path as a flag gives it: not empty, UTF-8 (qconvert records paths in UTF-8 JSON and cards), no
    control characters, each name within NAME_MAX bytes and the whole within PATH_MAX."""
    raw = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(raw, bytes):
        raw = os.fsdecode(raw)
    if not isinstance(raw, str) or not raw.strip():
        raise refuse(what, "is empty")
    if "\x00" in raw:
        raise refuse(what, "holds a NUL byte")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in raw):
        raise refuse(what, f"{shown(raw)} is not UTF-8 (qconvert records paths as UTF-8 text); rename it")
    _check_text(raw, what, max_bytes=PATH_MAX_BYTES)
    long_name = next((name for name in raw.split("/") if len(name.encode("utf-8")) > NAME_MAX_BYTES), None)
    if long_name is not None:
        raise refuse(what, f"has a name longer than {NAME_MAX_BYTES} bytes")
    return Path(raw)


def folder_names(folder: Path, what: str) -> Path:
    """`folder` (a resolved path) if every name on its way can be written as UTF-8 text; OutsideValueError
    naming the first that cannot (a parent's name counts: the card and qconvert.json record it)."""
    for part in Path(folder).parts:
        if any(0xD800 <= ord(ch) <= 0xDFFF for ch in part):
            raise refuse(what, f"lies in a folder whose name is not UTF-8 ({shown(part)}); rename it")
    return Path(folder)


def json_constant(name: str):
    """json.loads' `parse_constant`: NaN, Infinity and -Infinity are no JSON, and no config value qconvert keeps
    may be one."""
    raise OutsideValueError(f"holds {name}, which is not a JSON number")


def finite_json(value):
    """`value` with every NaN or infinite float replaced by None, so that the JSON qconvert writes is JSON (a
    figure that could not be computed is null, never a bare NaN a strict parser refuses)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


# The Hub's variables huggingface_hub parses strictly when it loads (a value it cannot parse is an exception
# from inside its import, wherever that happens).
HUB_WHOLE_NUMBERS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
_URL = re.compile(r"https?://[^/\s?#]+(?:/[^\s]*)?", re.ASCII)


def hub_environment(environ) -> None:
    """OutsideValueError naming the variable when HF_ENDPOINT is not an http(s) address or a timeout
    huggingface_hub reads is not a whole number of seconds."""
    endpoint = environ.get("HF_ENDPOINT")
    if endpoint is not None:
        text(endpoint, "HF_ENDPOINT")
        if not _URL.fullmatch(endpoint.strip()):
            raise refuse("HF_ENDPOINT", f"{shown(endpoint)!r} is not an http:// or https:// address")
    for name in HUB_WHOLE_NUMBERS:
        if environ.get(name, "").strip():
            whole_number(environ[name], f"{name} ({shown(environ[name])!r})", low=1, high=86_400)
