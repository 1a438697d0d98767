"""SIGINT, SIGTERM and SIGHUP at any moment of a run: one line, exit 130/143/129, no OUT, no temporaries."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint

QCONVERT = str(Path(sys.executable).parent / "qconvert")
LINES = {signal.SIGINT: "qconvert: error: interrupted",
         signal.SIGTERM: "qconvert: error: interrupted by SIGTERM",
         signal.SIGHUP: "qconvert: error: interrupted by SIGHUP"}


def tree(root: Path) -> dict[str, str | None]:
    """Every path under root with the sha256 of its bytes (None for a folder)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def handler_ready_seconds() -> float:
    """How long this machine takes to start Python and install qconvert's handlers (the slowest of three).

    A signal before that reaches a Python that has not run a line of qconvert yet, so the sweep starts there.
    """
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "from qconvert import interrupts; interrupts.install()"], check=True)
        times.append(time.monotonic() - started)
    return max(times)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("signals")
    make_llama_checkpoint(work / "src", hidden=128, layers=2, intermediate=256, vocab=128)
    (work / "notes.txt").write_text("not qconvert's")
    return work


W8A8_RUN = ["quantize", "src", "-o", "out", "--scheme", "w8a8", "--calib", "random", "--calib-samples", "4",
            "--calib-seqlen", "32", "--act", "static", "-q"]


def test_a_sweep_of_signal_times_over_a_w8a8_run_leaves_nothing(workdir):
    import shutil

    before = tree(workdir)
    start = max(0.05, 2 * handler_ready_seconds())
    began = time.monotonic()
    subprocess.run([QCONVERT, *W8A8_RUN], cwd=workdir, check=True)  # how long a whole run takes here
    duration = time.monotonic() - began
    shutil.rmtree(workdir / "out")
    # From interpreter start-up through imports, JAX start-up, calibration and writing, whatever the machine's speed.
    fractions = (0.0, 0.03, 0.08, 0.15, 0.25, 0.35, 0.5, 0.65, 0.8, 0.92)
    kinds = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    finished = 0
    for n, fraction in enumerate(fractions):
        sig, delay = kinds[n % 3], start + fraction * (duration - start)
        proc = subprocess.Popen([QCONVERT, *W8A8_RUN], cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        time.sleep(delay)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
        where = f"{sig.name} at {delay:.2f} s of a {duration:.1f} s run"
        if proc.returncode == 0:  # the run was complete before the signal came: a whole OUT, nothing else
            finished += 1
            assert (workdir / "out" / "qconvert.json").is_file(), where
            shutil.rmtree(workdir / "out")
        else:
            assert proc.returncode == 128 + sig, f"{where}: exit {proc.returncode}, stderr {stderr!r}"
            assert stderr.splitlines() == [LINES[sig]], f"{where}: stderr {stderr!r}"
        assert tree(workdir) == before, where
    assert finished <= 3  # nearly every signal lands mid-run


def start_stuck_process(setup: str = "") -> subprocess.Popen:
    """A Python with qconvert's handlers installed whose main thread then blocks in native code (a mutex
    locked twice), as in a backend that never starts; `setup` runs first. Returns once it is blocked."""
    script = f"""
import ctypes, os
from qconvert import interrupts
interrupts.install()
{setup}
mutex = ctypes.create_string_buffer(64)
libc = ctypes.CDLL(None)
libc.pthread_mutex_init(mutex, None)
libc.pthread_mutex_lock(mutex)
print("ready", flush=True)
libc.pthread_mutex_lock(mutex)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # into the second lock
    return proc


def test_a_stuck_main_thread_is_ended_by_the_watchdog_with_its_temporaries_removed(tmp_path):
    # The main thread blocks in native code (a mutex locked twice), as in a backend that never starts:
    # no Python handler can run there, so the watchdog cleans up and ends the process.
    temporary = tmp_path / ".out.abc.partial"
    proc = start_stuck_process(f"os.mkdir({str(temporary)!r}); interrupts.register_temporary({str(temporary)!r})")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143 and stderr.splitlines() == [LINES[signal.SIGTERM]]
    assert time.monotonic() - started < 10 and not temporary.exists()


def test_a_second_signal_ends_a_stuck_process_at_once(tmp_path):
    proc = start_stuck_process()
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and stderr.splitlines() == [LINES[signal.SIGINT]]
    assert time.monotonic() - started < 2.5  # well inside the grace period


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_removed_by_name_and_marker_and_nothing_else(workdir, tmp_path):
    import json

    from qconvert.write.folder import TEMPORARY_MARKER
    from qconvert.write.temporaries import owner_record

    parent = tmp_path / "parent"
    parent.mkdir()
    dead = json.dumps({**owner_record(), "pid": _dead_pid(), "start_time": None})
    live = json.dumps(owner_record(os.getppid()))
    stale = {".out.k3j2h1.partial": dead, ".out.a8b7c6.old": dead}
    kept = {".out.nomark.partial": None,                # our name, no marker: not ours to remove
            ".other.x1y2z3.partial": dead,              # another OUT's temporary
            ".out.live12.partial": live,                # a process that still runs
            "out.backup": dead}                          # not our name
    for name, pid in {**stale, **kept}.items():
        (parent / name).mkdir()
        (parent / name / "data.bin").write_bytes(b"x" * 10)
        if pid is not None:
            (parent / name / TEMPORARY_MARKER).write_text(pid)
    before = tree(parent)
    done = subprocess.run([QCONVERT, "quantize", str(workdir / "src"), "-o", str(parent / "out"), "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == ""
    after = tree(parent)
    expected = {k: v for k, v in before.items() if k.split("/")[0] not in stale}
    assert {k: v for k, v in after.items() if not k.startswith("out/") and k != "out"} == expected


def test_a_signal_during_overwrite_keeps_the_previous_out_intact(workdir):
    import shutil

    run = [QCONVERT, "quantize", "src", "-o", "prev", "--scheme", "nf4", "-q"]
    subprocess.run(run[:5] + ["-q"], cwd=workdir, check=True)  # an int8 OUT that --overwrite may replace
    before = tree(workdir)
    began = time.monotonic()
    subprocess.run(run + ["--overwrite"], cwd=workdir, check=True)
    duration = time.monotonic() - began
    subprocess.run(run[:5] + ["-q", "--overwrite"], cwd=workdir, check=True)  # back to the int8 one
    assert tree(workdir) == before
    start = max(0.05, 2 * handler_ready_seconds())
    try:
        for n, fraction in enumerate((0.3, 0.6, 0.8, 0.95)):
            sig = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGTERM)[n]
            proc = subprocess.Popen(run + ["--overwrite"], cwd=workdir, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            time.sleep(start + fraction * (duration - start))
            proc.send_signal(sig)
            _, stderr = proc.communicate(timeout=120)
            if proc.returncode == 0:  # finished first: prev is the new nf4 folder; put the int8 one back
                subprocess.run(run[:5] + ["-q", "--overwrite"], cwd=workdir, check=True)
            else:
                assert proc.returncode == 128 + sig and stderr.splitlines() == [LINES[sig]], stderr
            assert tree(workdir) == before, f"{sig.name} at {fraction:.2f} of the run"
    finally:
        shutil.rmtree(workdir / "prev", ignore_errors=True)
