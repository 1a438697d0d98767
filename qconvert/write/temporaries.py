"""Temporary folders beside OUT: named and marked as qconvert's, locked while their run lives, and removed once a
run that was killed left them behind.

A temporary's name is bounded: OUT's own name when it leaves room for the rest, else a prefix of it and a hash of
the whole, so that any OUT name the file system takes can be staged. The marker inside records who made the
folder: its pid, the start time of that process, this boot's id and the PID namespace, so that a folder is called
stale only when its maker is proven dead on this machine and in this namespace; a folder made in another
container (another PID namespace) or on another machine sharing the volume is never removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from qconvert import interrupts
from qconvert.formats.errors import OutputWriteError

# Inside every temporary folder qconvert makes beside OUT: proof that it is ours, and whose (owner_record()).
TEMPORARY_MARKER = ".qconvert-temporary"
TEMPORARY_SUFFIXES = (".partial", ".old", ".scratch")
# A temporary beside OUT is named ".<stem>.<8 random characters><suffix>" (tempfile.mkdtemp's).
TEMPORARY_NAME_EXTRA = len("..") + 8 + max(map(len, TEMPORARY_SUFFIXES))
NAME_MAX_BYTES = 255
# The stem of a long OUT name: a prefix of it, "~" and this many hex digits of the sha256 of the whole name.
_HASH_DIGITS = 16


def temporary_stem(name: str, name_max: int = NAME_MAX_BYTES) -> str:
    """The part of OUT's name its temporaries are named by: the name itself when the temporary's name fits in
    `name_max` bytes, else the longest prefix (whole characters) that fits with "~" and a hash of the name."""
    encoded = os.fsencode(name)
    room = name_max - TEMPORARY_NAME_EXTRA
    if len(encoded) <= room:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:_HASH_DIGITS]
    cut = max(0, room - 1 - _HASH_DIGITS)
    while 0 < cut and encoded[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
        cut -= 1
    return f"{os.fsdecode(encoded[:cut])}~{digest}"


def _name_max(folder: Path) -> int:
    try:
        return min(NAME_MAX_BYTES, int(os.pathconf(folder, "PC_NAME_MAX")))
    except (OSError, ValueError, AttributeError):
        return NAME_MAX_BYTES


def _temporary_pattern(out: Path) -> re.Pattern:
    stem = temporary_stem(out.name, _name_max(out.parent))
    return re.compile(rf"^\.{re.escape(stem)}\.[A-Za-z0-9_]+({'|'.join(map(re.escape, TEMPORARY_SUFFIXES))})$")


def make_temporary(out: Path, suffix: str) -> Path:
    """A private folder beside OUT holding the marker (made with signals held back, so it never lacks it).

    The marker is locked (flock) before its record is written, and for as long as this process runs: the proof
    of life another run checks, from any PID namespace, before it calls the folder stale."""
    with interrupts.deferred():
        stem = temporary_stem(out.name, _name_max(out.parent))
        path = Path(tempfile.mkdtemp(prefix=f".{stem}.", suffix=suffix, dir=out.parent))
        interrupts.register_temporary(path)
        try:
            _write_marker(path, path / TEMPORARY_MARKER)
        except OSError:
            discard(path)
            raise
    return path


# Temporary folder -> the open descriptor of its locked marker (closed when the folder is discarded or kept).
_LOCKS: dict[Path, int] = {}


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[inode]": the namespace this process's pids belong to
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field), or None."""
    stat = _read_text(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(")", 1)[1].split()[19]) if stat else None
    except (IndexError, ValueError):
        return None


def owner_record(pid: int | None = None) -> dict:
    """Who makes a temporary: the process (pid and start time), its PID namespace, this boot and this host."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_time": _start_time(pid), "pid_namespace": _pid_namespace(),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "host": socket.gethostname()}


def _write_marker(path: Path, marker: Path) -> None:
    """The marker, locked before its record is written: a reader finds it locked, or its record whole."""
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _LOCKS[path] = fd
    except (ImportError, OSError):  # no flock here: the record alone speaks for the run
        pass
    os.write(fd, (json.dumps(owner_record(), sort_keys=True) + "\n").encode("ascii"))
    if path not in _LOCKS:
        os.close(fd)


def release(path: Path) -> None:
    """Let go of the lock on a temporary's marker (the folder is kept: it became OUT, or is being removed)."""
    fd = _LOCKS.pop(Path(path), None)
    if fd is not None:
        os.close(fd)


def _locked_by_a_live_run(marker: Path) -> bool:
    """Whether a running process holds the marker's lock (in this PID namespace or another)."""
    try:
        import fcntl

        fd = os.open(marker, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its run is alive
    finally:
        os.close(fd)  # closing drops the lock taken to look
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def proven_dead(record: object) -> bool:
    """Whether the process a marker's record names is proven to run no more: made on this boot of this machine
    and in this PID namespace (else its pid means nothing here), and its pid runs nothing now, or a process
    that started at another time (the pid was reused). A record that says less, or that cannot be read, proves
    nothing: its folder is kept."""
    if not isinstance(record, dict):
        return False
    pid, start = record.get("pid"), record.get("start_time")
    if type(pid) is not int or pid <= 0 or (start is not None and type(start) is not int):
        return False
    here = owner_record()
    if pid == here["pid"]:
        return False
    for key in ("boot_id", "pid_namespace", "host"):
        if record.get(key) != here[key]:
            return False
    if here["boot_id"] is None or here["pid_namespace"] is None:
        return not _alive(pid)  # a system without /proc: no PID namespaces, one host
    if not _alive(pid):
        return True
    now = _start_time(pid)
    return start is not None and now is not None and now != start


def _marker_record(marker: Path) -> object:
    try:
        return json.loads(marker.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None


def stale_temporaries(out: Path) -> list[Path]:
    """Temporary folders beside OUT left by an earlier run that was killed: named like ours, holding our
    marker, made by a process proven dead (proven_dead) whose lock nothing holds. Nothing else is ever listed."""
    parent, pattern = out.parent, _temporary_pattern(out)
    if not parent.is_dir():
        return []
    stale = []
    for entry in sorted(parent.iterdir()):
        marker = entry / TEMPORARY_MARKER
        if not pattern.match(entry.name) or entry.is_symlink() or not entry.is_dir() or not marker.is_file():
            continue
        if not _locked_by_a_live_run(marker) and proven_dead(_marker_record(marker)):
            stale.append(entry)
    return stale


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove what `stale_temporaries` finds; returns the folders removed."""
    removed = stale_temporaries(out)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def discard(path: Path) -> None:
    """Remove a temporary of this run, its lock and its registration with the signal handlers."""
    release(path)
    shutil.rmtree(path, ignore_errors=True)
    interrupts.unregister_temporary(path)


def fresh_temporary(out: Path, suffix: str, what: str) -> Path:
    """A new marked temporary folder beside OUT, after removing any a killed run left there (exit 9 on failure)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        return make_temporary(out, suffix)
    except OSError as err:
        raise OutputWriteError(f"cannot create {what} beside {out}: {err.strerror or err}") from None
