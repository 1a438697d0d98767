"""Whether a file qconvert replaces on request (by writing beside it and renaming over it) can be replaced: known
before the work that ends in the write, so a refusal comes first and not after a verdict.

A folder that takes a new file may still refuse the rename: the file or its folder marked immutable or
append-only (chattr +i / +a: even root cannot rename over them or remove an entry), the file a mount point of its
own (a file bind-mounted into a container: EBUSY), or another user's file in a sticky folder such as /tmp. The
folder's own writability is check_writable's.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from pathlib import Path

from qconvert.formats.errors import OutputWriteError

# Linux's inode flags (FS_IOC_GETFLAGS, _IOR('f', 1, long)) that forbid renaming over a file or in a folder.
_FS_IOC_GETFLAGS = 0x80000000 | (struct.calcsize("l") << 16) | (ord("f") << 8) | 1
_FLAGS = ((0x10, "immutable (chattr +i)"), (0x20, "append-only (chattr +a)"))


def inode_flags(path: Path) -> int | None:
    """The file's or folder's inode flags, or None where the system or file system does not say."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except (ImportError, OSError):
        return None
    try:
        raw = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(raw[:4], "little" if struct.pack("=I", 1)[0] == 1 else "big")


def _is_mount_point(path: Path) -> bool:
    """Whether `path` is where something is mounted (/proc/self/mountinfo's fifth field; a file bind-mounted
    shares its folder's device, so the device numbers do not tell)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 4 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4]) == target:
                    return True
    except OSError:
        return os.path.ismount(path)
    return False


def _refusal(path: Path) -> str | None:
    flags = inode_flags(path)
    for bit, words in _FLAGS:
        if flags is not None and flags & bit:
            return f"{path} is {words}"
    return None


def _sticky_refusal(folder: Path, path: Path) -> str | None:
    """In a sticky folder (/tmp's mode), only the file's owner, the folder's or root may rename over a file."""
    try:
        folder_stat, file_stat, user = os.stat(folder), os.lstat(path), os.geteuid()
    except (OSError, AttributeError):
        return None
    if folder_stat.st_mode & stat.S_ISVTX and user not in (0, folder_stat.st_uid, file_stat.st_uid):
        return f"{path} belongs to another user in a sticky folder ({folder})"
    return None


def check_replaceable(path: Path, what: str) -> None:
    """OutputWriteError (exit 9) when `path` could not be replaced by a rename: it, or the folder that holds it,
    is immutable or append-only, or it is a mount point. A file not there yet needs only its folder."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    reason = _refusal(folder) if folder.is_dir() else None
    if reason is None and os.path.lexists(path) and not path.is_symlink():
        reason = _refusal(path) or _sticky_refusal(folder, path)
        if reason is None and _is_mount_point(path):
            reason = f"{path} is a mount point of its own (a file mounted there)"
    if reason is not None:
        raise OutputWriteError(f"cannot write {what}: {reason}, so {path.name} cannot be replaced there; choose a "
                               "place you can write to, before anything is computed")
