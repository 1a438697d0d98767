"""How a command ends: one exit code, one stderr line on failure, one --json document, whatever ends it.

Every way out passes here: a command's own result (`hold_document`, printed once the run's outcome is final, so
a run of several processes never prints success before a peer's failure), a refusal or an internal error
(`say_failure`, from the main thread), a signal, a peer's failure or a deadline (`say_failure` again, as the
last words of the thread that ends the process). The first failure said is the one printed: a held document it
replaces is never printed, and a second failure prints nothing more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import click


class _Run:
    """What the exit path needs to know of the command running: its name where it was given --json, where else
    the document goes (verify's --json-file, once its target is checked), the OUT it was given, the document its
    result left to print, and whether the one failure has been said."""

    json_command: str | None = None
    record_command: str | None = None
    write_record: Callable[[str], None] | None = None
    out: str | None = None
    held: str | None = None  # the result's document, printed when the run ends as it says
    held_code: int | None = None
    said = False
    lock = threading.Lock()


def start(json_command: str | None) -> None:
    """A command starts: nothing held or said yet; with --json (`json_command`), failures print its document."""
    _Run.json_command, _Run.record_command, _Run.write_record = json_command, None, None
    _Run.out, _Run.held, _Run.held_code, _Run.said = None, None, None, False


def record_failures(command: str, write: Callable[[str], None]) -> None:
    """Failures from here on also hand the command's JSON error document to `write` (a file the user named)."""
    _Run.record_command, _Run.write_record = command, write


def note_out(out) -> None:
    """The OUT a command was given, for its JSON error document."""
    _Run.out = None if out is None else str(out)


def hold_document(command: str, body: dict, exit_code: int = 0, error: str | None = None) -> None:
    """A command's result as its --json document (the shared envelope, then its own fields), printed when the run
    ends with `exit_code`. With `error` (a result that ends in that refusal) it is the run's one document: the
    refusal's line follows, and no error document."""
    from qconvert import __version__
    from qconvert.formats.documents import dumps, envelope
    from qconvert.formats.outside import shown

    out = body.get("out")
    _Run.held = dumps({**envelope(command, __version__, exit_code=exit_code, out=None if out is None else str(out),
                                  error=None if error is None else shown(error)), **body})
    _Run.held_code = exit_code
    if error is not None:
        _Run.json_command = _Run.record_command = None


def say_failure(message: str, exit_code: int, *, leader: bool = True, line: str | None = None) -> bool:
    """The failure's JSON document (where --json or a record asks for one, from the process that speaks for the
    run) and its one stderr line (`line`, or `qconvert: error: <message>`); False, printing nothing, when a
    failure was said already."""
    from qconvert.formats.outside import shown

    with _Run.lock:
        if _Run.said:
            return False
        _Run.said = True
    message = shown(message)
    held, _Run.held = _Run.held, None
    if held is not None and _Run.json_command is None and _Run.held_code == exit_code:
        click.echo(held)  # a result that ends in this refusal: its document is the run's one
    elif leader:
        _print_error_document(message, exit_code)
    _error_line(line or f"qconvert: error: {message}")
    return True


def finish(code: int) -> None:
    """The run ended with `code` as its command said: print the held document (if it says that code)."""
    held, _Run.held = _Run.held, None
    if held is not None and not _Run.said and _Run.held_code == code:
        click.echo(held)


def _print_error_document(message: str, exit_code: int) -> None:
    command = _Run.json_command or _Run.record_command
    if command is None:
        return
    from qconvert import __version__
    from qconvert.formats.documents import dumps, error_document

    text = dumps(error_document(command, __version__, message, exit_code, _Run.out))
    if _Run.json_command is not None:
        click.echo(text)
    write, _Run.write_record = _Run.write_record, None  # once: a failure to write it fails nothing again
    if write is not None:
        from qconvert.formats.errors import QConvertError

        try:
            write(text)
        except (QConvertError, OSError) as err:  # the run's own line stays the one that matters
            click.echo(f"qconvert: the error record was not written: {err}", err=True)


def _error_line(line: str) -> None:
    """The line on stderr: through click from the main thread; from a thread that ends the process, written
    straight to the descriptor Python's stderr uses (the thread leaves without flushing buffers)."""
    if threading.current_thread() is threading.main_thread():
        click.echo(line, err=True)
        return
    import os
    import sys

    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"{line}\n".encode(errors="backslashreplace"))
    except (AttributeError, ValueError, OSError):
        pass
