"""SIGINT, SIGTERM and SIGHUP made deterministic: one exception in the main thread, temporaries removed, one exit code.

Only the standard library is imported here, so the console entry point can
install the handlers before click, JAX or numpy are imported.

Once `install()` has run, the first signal raises `Interrupted` in the main
thread, where `finally` blocks remove the temporaries. A library that swallows
the exception (a bare `except:` during an import, say) cannot make it vanish:
`check()` re-raises a received signal, and the output is committed only through
`commit_zone()`, which refuses to commit after a signal. A signal that arrives
once the output is committed is ignored: the run is then complete, so the
outcome is either "interrupted, nothing written" or "finished"; only work that
follows the output and opts in (`stoppable_after_commit`: an upload of it) is
stopped, the output left complete.

A main thread stuck in native code (a backend that never finishes starting)
never runs a Python handler; a watchdog thread woken by the signal then removes
the registered temporaries itself and ends the process after a grace period, or
at once on a second signal.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# Seconds the main thread gets to clean up after a signal before the watchdog does it.
GRACE_SECONDS = 3.0


class Interrupted(BaseException):
    """A signal asked qconvert to stop; exit code 128 + the signal number (SIGINT 130, SIGTERM 143, SIGHUP 129).

    Like KeyboardInterrupt it is no Exception, so `except Exception` does not swallow it; unlike it, click
    does not turn it into Abort (and print an empty line first).
    """

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def message(self) -> str:
        return "interrupted" if self.signum == signal.SIGINT else f"interrupted by {signal.Signals(self.signum).name}"


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.received: int | None = None
        self.raised = False
        self.deferred = 0
        self.committed = False
        self.committing = False
        self.temporaries: set[Path] = set()
        self.exiting = False
        self.lock = threading.Lock()
        self.last_words: list = []  # (message, code) -> None, before a thread ends the process
        self.sayer = None  # (message, code) -> None: the failure's document and line (the CLI's exit path)


_state = _State()


def exit_code_for(err: BaseException) -> int:
    """The exit code of an interruption (a plain KeyboardInterrupt is SIGINT)."""
    return err.exit_code if isinstance(err, Interrupted) else 128 + signal.SIGINT


def message_for(err: BaseException) -> str:
    return err.message if isinstance(err, Interrupted) else "interrupted"


def _importing(frame) -> bool:
    """Whether the main thread is inside an import: native extensions initialising there can abort or print
    their own traceback when an exception appears mid-way, so the signal waits for the next check()."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _handle(signum: int, frame) -> None:
    if _state.received is None:
        _state.received = signum
    if _state.committed or _state.deferred or _state.raised or _importing(frame):
        return  # committed: the run is complete; otherwise the next check() raises
    _state.raised = True
    raise Interrupted(signum)


def install() -> None:
    """Install the handlers (main thread only) and start the watchdog. Call before heavy imports."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.__init__()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    threading.Thread(target=_watchdog, args=(read_fd,), name="qconvert-signal-watchdog", daemon=True).start()
    sys.unraisablehook = _unraisable_hook(sys.unraisablehook)
    _state.installed = True
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    reinstall()


def reinstall() -> None:
    """Put qconvert's handlers back (main thread, after install()): a library that took a signal for itself
    (jax.distributed's preemption notifier takes SIGTERM) no longer decides what it does."""
    if threading.current_thread() is not threading.main_thread() or not _state.installed:
        return
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def add_last_words(say) -> None:
    """`say(message, exit_code)` runs before a thread ends the process (the watchdog after a signal, a run's
    watch): the JSON document of a command given --json, the other processes of a run told. Each runs once,
    in the order added; what one raises is dropped."""
    with _state.lock:
        _state.last_words.append(say)


def set_sayer(say) -> None:
    """`say(message, exit_code)` prints a failure's one line (and its --json document) when a thread ends the
    process: the CLI's one exit path. Without it, the line alone is written."""
    _state.sayer = say


def end_from_thread(message: str, code: int) -> None:
    """End the process from a thread (the signal watchdog, a run's watch, a deadline): temporaries removed, the
    last words said, the failure said through the sayer, exit `code` (never returns). The caller has claimed
    the exit (claim_exit)."""
    remove_temporaries()
    try:
        say_last_words(message, code)
        if _state.sayer is not None:
            _state.sayer(message, code)
        else:
            error_line(message)
    finally:
        flush_and_exit(code)


def say_last_words(message: str, code: int) -> None:
    """Run the last words (see add_last_words), once."""
    with _state.lock:
        words, _state.last_words = _state.last_words, []
    for say in words:
        with contextlib.suppress(Exception):
            say(message, code)


def error_line(message: str) -> None:
    """The one `qconvert: error:` line, written by a thread that ends the process (to the stderr Python writes
    to, which native code's descriptor 2 may no longer be)."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):
        fd = 2
    with contextlib.suppress(OSError):
        os.write(fd, f"qconvert: error: {message}\n".encode(errors="backslashreplace"))


def _unraisable_hook(previous):
    """Where Python can only ignore an exception (a gc callback, __del__), an Interrupted is dropped quietly,
    and the next signal raises again; check() still sees the first."""
    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, Interrupted):
            _state.raised = False
            return
        previous(unraisable)

    return hook


def _watchdog(read_fd: int) -> None:
    """Wake on a signal; if the process is still alive after the grace period (or on a second signal), end it."""
    while True:
        data = os.read(read_fd, 64)
        if not data:
            return
        ours = [n for n in data if n in SIGNALS]
        if not ours or _state.committed:
            continue
        _wait_for_second_signal(read_fd)
        while _state.committing:  # the renames into OUT are short: let them finish, then decide
            time.sleep(0.01)
        if _state.committed:
            continue
        signum = _state.received or ours[0]
        if not claim_exit():  # the main thread is printing its line and leaving: give it a moment
            _wait_for_second_signal(read_fd)
            os._exit(128 + signum)
        end_from_thread(Interrupted(signum).message, 128 + signum)


def claim_exit() -> bool:
    """True for the one caller (main thread or watchdog) that prints the interruption's line."""
    with _state.lock:
        if _state.exiting:
            return False
        _state.exiting = True
        return True


def _wait_for_second_signal(read_fd: int) -> bool:
    """Sleep up to GRACE_SECONDS, returning early (True) if another signal arrives."""
    import select

    ready, _, _ = select.select([read_fd], [], [], GRACE_SECONDS)
    if ready:
        os.read(read_fd, 64)
        return True
    return False


def received() -> int | None:
    """The first signal received since install(), or None."""
    return _state.received


def check() -> None:
    """Raise Interrupted if a signal arrived (even if something swallowed the first exception)."""
    if _state.received is not None and not _state.committed:
        _state.raised = True
        raise Interrupted(_state.received)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Signals inside the block are held back and raised on leaving it (temporaries get their marker first)."""
    _state.deferred += 1
    try:
        yield
    finally:
        _state.deferred -= 1
    if not _state.deferred:
        check()


@contextlib.contextmanager
def commit_zone() -> Iterator[callable]:
    """The output's final renames: refused after a signal; once `committed()` is called, signals are ignored."""
    def committed() -> None:
        if _state.installed:
            _state.committed = True

    with deferred():
        check()
        _state.committing = True
        try:
            yield committed
        finally:
            _state.committing = False


@contextlib.contextmanager
def stoppable_after_commit() -> Iterator[None]:
    """Work after the output is committed that a signal must still stop (uploading it, which can take hours):
    inside, a signal raises Interrupted as before the commit, and one received since the commit stops the run
    before the work starts. The output stays as committed: it is complete."""
    committed = _state.committed
    _state.committed = False
    try:
        check()
        yield
    finally:
        _state.committed = committed


def register_temporary(path: Path) -> None:
    """A temporary folder to remove if the watchdog has to end the process."""
    with _state.lock:
        _state.temporaries.add(Path(path))


def unregister_temporary(path: Path) -> None:
    with _state.lock:
        _state.temporaries.discard(Path(path))


def remove_temporaries() -> None:
    """Remove every registered temporary folder (a few tries: a writer may still be adding files)."""
    with _state.lock:
        paths = list(_state.temporaries)
    for path in paths:
        for _ in range(5):
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                break


def flush_and_exit(code: int) -> None:
    """Leave at once after an interruption: no interpreter teardown while native threads still run."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
