"""The `qconvert` console script: signal handlers first, then the CLI and everything heavy it imports."""

from __future__ import annotations

import signal
import sys

from qconvert import interrupts


def main() -> None:
    """Install the SIGINT/SIGTERM/SIGHUP handlers, then run the CLI; an interruption ends the process at once."""
    try:
        interrupts.install()
        from qconvert.cli.main import main as cli_main

        cli_main()
    except SystemExit as done:
        # Every line is printed and the temporaries are gone: leave without the interpreter's teardown,
        # which can crash while native (XLA) threads still run, and which puts the default signal
        # handlers back (a signal then would kill a run that has already finished).
        if done.code is not None and not isinstance(done.code, int):
            sys.stderr.write(f"{done.code}\n")
        interrupts.flush_and_exit(done.code if isinstance(done.code, int) else (0 if done.code is None else 1))
    except BaseException as err:  # a signal while the CLI itself was being imported
        signum = interrupts.received()
        if signum is None and not isinstance(err, (KeyboardInterrupt, interrupts.Interrupted)):
            raise
        interrupted = interrupts.Interrupted(signum or signal.SIGINT)
        sys.stderr.write(f"qconvert: error: {interrupted.message}\n")
        interrupts.flush_and_exit(interrupted.exit_code)


if __name__ == "__main__":
    main()
