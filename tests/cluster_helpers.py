"""Launching a run of several qconvert processes on 127.0.0.1 (2 forced CPU devices each, gloo collectives), with
qconvert's join deadline short, and reading what each process left: its exit code, its error lines, its JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# Seconds the processes of a fault test wait for one another (QCONVERT_JOIN_TIMEOUT) where one is meant to be
# missing; a run meant to join waits JOINED_S, which a loaded machine's imports and JAX start meet.
JOIN_S = 6
JOINED_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int = 2, join_s: float | None = None) -> dict[str, str]:
    """A process's environment: CPU JAX with `devices` forced devices, the Hub offline, the launchers' variables
    of the test's own shell dropped; `join_s`: qconvert's join deadline (None: its default)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "SLURM_", "OMPI_"))}
    environ.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    if join_s is not None:
        environ["QCONVERT_JOIN_TIMEOUT"] = str(join_s)
    if devices > 1:
        environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return environ


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-c", "from qconvert.cli.entry import main; main()", *args]


def launch(args: list[str], port: int, count: int, index: int, join_s: float = JOIN_S, **popen) -> subprocess.Popen:
    """One process of a run: `args` and the run's flags; a run meant to join gets a deadline a loaded machine
    meets (`join_s`), a run meant to miss a process the short JOIN_S."""
    return subprocess.Popen(command([*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count),
                                     "--process-id", str(index)]),
                            env=env(join_s=join_s), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


def the_error(stderr: str) -> str:
    """The one stderr line a failed process leaves (asserting it is the only line)."""
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("qconvert: error: "), stderr[-3000:]
    return lines[0].removeprefix("qconvert: error: ")


def the_document(stdout: str, code: int, line: str) -> dict:
    """The one --json document on stdout, of a run that failed with `code` and `line`."""
    document = json.loads(stdout)  # one document, nothing else
    assert document["exit_code"] == code and document["error"] == line, document
    return document


def wait_for(condition, timeout: float, what: str) -> None:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"no {what} within {timeout} s"
        time.sleep(0.05)


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port (a connection made and closed at once)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())
