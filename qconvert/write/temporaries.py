"""Temporary folders beside OUT: named and marked as qconvert's, locked while their run lives, and removed once a
run that was killed left them behind."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from qconvert import interrupts
from qconvert.formats.errors import OutputWriteError

# Inside every temporary folder qconvert makes beside OUT: proof that it is ours (and whose: a pid).
TEMPORARY_MARKER = ".qconvert-temporary"
TEMPORARY_SUFFIXES = (".partial", ".old", ".scratch")
# A temporary beside OUT is named ".<name>.<8 random characters><suffix>" (tempfile.mkdtemp's).
TEMPORARY_NAME_EXTRA = len("..") + 8 + max(map(len, TEMPORARY_SUFFIXES))


def _temporary_pattern(out: Path) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(out.name)}\.[A-Za-z0-9_]+({'|'.join(map(re.escape, TEMPORARY_SUFFIXES))})$")


def make_temporary(out: Path, suffix: str) -> Path:
    """A private folder beside OUT holding the marker (made with signals held back, so it never lacks it).

    The marker is locked (flock) for as long as this process runs: the proof of life another run checks, from
    any PID namespace (another container on a shared volume), before it calls the folder stale."""
    with interrupts.deferred():
        path = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=suffix, dir=out.parent))
        interrupts.register_temporary(path)
        marker = path / TEMPORARY_MARKER
        marker.write_text(f"{os.getpid()}\n", encoding="ascii")
        _hold(path, marker)
    return path


# Temporary folder -> the open descriptor of its locked marker (closed when the folder is discarded or kept).
_LOCKS: dict[Path, int] = {}


def _hold(path: Path, marker: Path) -> None:
    try:
        import fcntl

        fd = os.open(marker, os.O_RDONLY)
    except (ImportError, OSError):
        return  # no flock here: the pid alone speaks for the run
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return
    _LOCKS[path] = fd


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


def stale_temporaries(out: Path) -> list[Path]:
    """Temporary folders beside OUT left by an earlier run that was killed: named like ours, holding our
    marker, made by a process that no longer runs. Nothing else is ever listed."""
    parent, pattern = out.parent, _temporary_pattern(out)
    if not parent.is_dir():
        return []
    stale = []
    for entry in sorted(parent.iterdir()):
        marker = entry / TEMPORARY_MARKER
        if not pattern.match(entry.name) or entry.is_symlink() or not entry.is_dir() or not marker.is_file():
            continue
        try:
            pid = int(marker.read_text(encoding="ascii").strip())
        except (OSError, ValueError):
            continue
        # Stale only when nothing holds its lock (a run in another container holds it with a pid that means
        # nothing here) and its pid runs nowhere here (a run of a qconvert that took no lock).
        if pid != os.getpid() and not _locked_by_a_live_run(marker) and not _alive(pid):
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
