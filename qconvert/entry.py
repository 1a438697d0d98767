"""The `qconvert` console script: signal handlers first, then the CLI and everything heavy it imports."""

from __future__ import annotations

from qconvert import interrupts


def main() -> None:
    """Install the SIGINT/SIGTERM/SIGHUP handlers, then run the CLI; an interruption ends the process at once."""
    interrupts.install()
    try:
        from qconvert.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt as err:  # arrived while the CLI itself was being imported
        import sys

        sys.stderr.write(f"qconvert: error: {interrupts.message_for(err)}\n")
        interrupts.flush_and_exit(interrupts.exit_code_for(err))
    except SystemExit as done:
        if interrupts.received() is not None and done.code == 128 + interrupts.received():
            # Temporaries are gone and the line is printed; skip the interpreter's teardown,
            # which can crash while native (XLA) threads are still running.
            interrupts.flush_and_exit(done.code)
        raise


if __name__ == "__main__":
    main()
