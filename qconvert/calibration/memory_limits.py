"""How much more memory this process may take: the least of what the machine has available, what its address
space limit (RLIMIT_AS) leaves, and what its control group's memory limit leaves (cgroup v2 memory.max, v1
memory.limit_in_bytes, at its own level and every level above it). A CI container or a Kubernetes pod sets the
last; `ulimit -v` the second. Each is read as the kernel states it, and one that cannot be read is left out.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest multiple of the page size below 2^63.
_UNLIMITED = 2**62


@dataclasses.dataclass(frozen=True)
class Headroom:
    """Bytes this process may still take, and which limit says so (for a message)."""

    bytes: int
    source: str


def machine_available() -> Headroom | None:
    """The memory this machine has free for a new allocation (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return Headroom(int(line.split()[1]) * 1024, "this machine's available memory")
    except (OSError, ValueError, IndexError):
        pass
    try:
        return Headroom(int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE")),
                        "this machine's available memory")
    except (AttributeError, OSError, ValueError):
        return None


def address_space_left() -> Headroom | None:
    """RLIMIT_AS's soft limit less this process's address space now (VmSize), or None when it has none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    used = _status_kib("VmSize")
    return Headroom(max(0, soft - (used or 0) * 1024), f"this process's address space limit (RLIMIT_AS, "
                                                     f"{soft / 2**30:,.1f} GiB)")


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cgroup_left(proc_cgroup: Path | None = None, root: Path | None = None) -> Headroom | None:
    """The least a memory limit of this process's control group or of a group above it leaves (the limit less
    the group's usage, its inactive file pages counted free as the kernel reclaims them), or None: no limit.
    `proc_cgroup` (default /proc/self/cgroup) names the groups, under `root` (default /sys/fs/cgroup)."""
    proc_cgroup, root = proc_cgroup or PROC_CGROUP, root or CGROUP_ROOT
    try:
        lines = Path(proc_cgroup).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found += _levels(Path(root), parts[2], "memory.max", "memory.current", "inactive_file")
        elif "memory" in parts[1].split(","):
            found += _levels(Path(root) / "memory", parts[2], "memory.limit_in_bytes", "memory.usage_in_bytes",
                             "total_inactive_file")
    return min(found, key=lambda h: h.bytes, default=None)


def _levels(mount: Path, path: str, limit_file: str, usage_file: str, inactive: str) -> list[Headroom]:
    """What each level's limit leaves, from the group's own folder up to the mount (a container's cgroup
    namespace shows its group as the mount itself)."""
    out = []
    folder = mount / path.strip("/")
    while True:
        limit = _number(folder / limit_file)
        if limit is not None and limit < _UNLIMITED:
            usage = _number(folder / usage_file) or 0
            free = _stat(folder / "memory.stat", inactive)
            where = f"{folder / limit_file}"
            out.append(Headroom(max(0, limit - usage + min(free, usage)),
                                f"this process's cgroup memory limit ({where}, {limit / 2**30:,.1f} GiB)"))
        if folder == mount or mount not in folder.parents:
            return out
        folder = folder.parent


def _number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    return 0


def available(proc_cgroup: Path | None = None, root: Path | None = None) -> Headroom | None:
    """The least of the machine's available memory, RLIMIT_AS's room and the cgroup's: what this process may
    still allocate, and the limit that says so (None where none can be read)."""
    candidates = [h for h in (machine_available(), address_space_left(), cgroup_left(proc_cgroup, root)) if h]
    return min(candidates, key=lambda h: h.bytes, default=None)
