"""The click face of qconvert: parses, prints, sets exit codes; no math lives here.

Exit codes: 0 success; 1 verification failed; 2 usage errors; 3..9 the kinds of
bad input in qconvert.errors; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys

import click

from qconvert import __version__
from qconvert.errors import INTERRUPTED_EXIT_CODE, QConvertError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qconvert")
def cli() -> None:
    """Quantize Hugging Face checkpoints (W8A8, int8, NF4) and verify the result."""


def fail(message: str, exit_code: int) -> None:
    """Print one line on stderr and exit."""
    click.echo(f"qconvert: error: {message}", err=True)
    sys.exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: every known failure becomes one line and an exit code."""
    try:
        exit_code = cli.main(args=argv, prog_name="qconvert", standalone_mode=False)
    except QConvertError as err:
        fail(str(err), err.exit_code)
    except click.exceptions.Abort:
        fail("interrupted", INTERRUPTED_EXIT_CODE)
    except KeyboardInterrupt:
        fail("interrupted", INTERRUPTED_EXIT_CODE)
    except click.ClickException as err:
        fail(err.format_message(), 2)
    except OSError as err:
        fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), 9)
    # A command may return its exit code (verify returns 1 when a check fails).
    sys.exit(exit_code if isinstance(exit_code, int) else 0)


if __name__ == "__main__":
    main()
