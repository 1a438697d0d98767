"""stdout as its reader left it: closed before the command started (`>&-`) or while it writes (`| head -1`).

Where stdout goes is the reader's choice: the output is dropped, nothing is said about it, and the command's
own result decides the exit code (a folder written is still written, a failed check still fails).
"""

from __future__ import annotations

import contextlib
import os
import sys


class ReaderGuardedStdout:
    """A text stream in front of stdout that drops what is written once the reader has closed the pipe."""

    def __init__(self, stream):
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def isatty(self) -> bool:
        return not self.reader_gone and self._stream.isatty()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _reader_left(self) -> None:
        self.reader_gone = True
        # The interpreter flushes stdout once more on its way out: point the descriptor at the null device so
        # that flush cannot fail again.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)


def guard_stdout() -> None:
    """Put stdout behind ReaderGuardedStdout, or the null device where there is none (closed at start); on both
    stdout and stderr, a character their encoding lacks (PYTHONIOENCODING=ascii and a folder named 'été')
    is written as an escape instead of failing."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    elif not isinstance(sys.stdout, ReaderGuardedStdout):
        sys.stdout = ReaderGuardedStdout(sys.stdout)


def native_output_silenced() -> None:
    """Descriptors 1 and 2 both pointed at the null device for native code, Python's stdout and stderr keeping
    where they went: gloo's connection lines (std::cout) and gRPC's, absl's and XLA's log lines (stderr: a
    taken port's `add_port.cc` line, a peer's heartbeat) never reach the reader. qconvert's own lines, the
    watchdog's included, are written through Python's streams."""
    _silence_native(1, "stdout")
    _silence_native(2, "stderr")


def _silence_native(fd: int, name: str) -> None:
    """Descriptor `fd` pointed at the null device; Python's sys.<name> writes on to a copy of where it went."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        current = getattr(sys, name)
        current.flush()
        guarded = isinstance(current, ReaderGuardedStdout)
        inner = current._stream if guarded else current
        if inner.fileno() != fd:
            return  # already moved off the descriptor
        kept = os.dup(fd)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
        import io

        stream = io.TextIOWrapper(io.FileIO(kept, "w", closefd=True), encoding=inner.encoding,
                                  errors="backslashreplace", line_buffering=inner.line_buffering,
                                  write_through=fd == 2)
        if guarded:
            current._stream = stream
        else:
            setattr(sys, name, stream)
