"""Running the CLI in-process and snapshotting folders, for the tests of what a command leaves behind."""

from __future__ import annotations

import hashlib
import json

import pytest

from qconvert.cli.main import main

# A child process's own peak resident memory in bytes, as Python source to run in the child: /proc/self/status's
# VmHWM belongs to the memory map exec made. getrusage's ru_maxrss does not: Linux carries the parent's high-water
# mark into it across fork and exec, so a child of a large pytest process reports at least the parent's peak.
PEAK_RSS_BYTES = "int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1]) * 1024"


def run(argv, capsys):
    """Run the console entry point in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def quantize_quietly(source, out, *args):
    """`qconvert quantize SOURCE -o OUT -q ARGS` in-process; asserts exit 0 and returns OUT."""
    with pytest.raises(SystemExit) as done:
        main(["quantize", str(source), "-o", str(out), "-q", *args])
    assert done.value.code == 0
    return out


def tree(root):
    """Every path under root with the sha256 of its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def servers_cell(out, capsys) -> str:
    """What `qconvert inspect` (the servers table) says of transformers for the folder."""
    code, report, err = run(["inspect", str(out), "--json"], capsys)
    assert code == 0, err
    return json.loads(report)["servers"]["transformers"]
