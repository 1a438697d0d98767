"""The click face of qconvert: parses, prints, sets exit codes; no math lives here.

Exit codes: 0 success; 1 verification failed; 2 usage errors; 3..9 the kinds of
bad input in qconvert.errors; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys
from pathlib import Path

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


@cli.command()
@click.argument("model")
@click.option("-o", "--out", "out", required=True, type=click.Path(path_type=Path),
              help="Output folder (written beside, then renamed into place).")
@click.option("--scheme", type=click.Choice(["int8", "nf4", "w8a8"]), default="int8", show_default=True,
              help="int8: W8A16 pack-quantized; nf4: bitsandbytes 4-bit; w8a8: int8 weights and activations.")
@click.option("--revision", default=None, help="Hub branch, tag or commit (Hub ids only).")
@click.option("--include", multiple=True, metavar="PATTERN",
              help="Also quantize modules matching a glob or re:REGEX (repeatable), e.g. lm_head.")
@click.option("--exclude", multiple=True, metavar="PATTERN",
              help="Keep modules matching a glob or re:REGEX in float (repeatable).")
@click.option("--max-shard-size", default="5GiB", show_default=True, help="Largest shard, e.g. 5GiB, 500MB.")
@click.option("--double-quant", is_flag=True, help="NF4: quantize the absmax values too (bitsandbytes).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("--dry-run", is_flag=True, help="List what would be quantized and the expected size; write nothing.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
def quantize(model: str, out: Path, scheme: str, revision: str | None, include: tuple[str, ...],
             exclude: tuple[str, ...], max_shard_size: str, double_quant: bool, overwrite: bool,
             dry_run: bool, quiet: bool, as_json: bool) -> int:
    """Quantize MODEL (a local folder or a Hugging Face Hub id) into OUT."""
    from qconvert.convert import ConvertOptions, convert
    from qconvert.plan import parse_size

    options = ConvertOptions(scheme=scheme, revision=revision, include=include, exclude=exclude,
                             max_shard_size=parse_size(max_shard_size), double_quant=double_quant,
                             overwrite=overwrite, dry_run=dry_run)
    result = _run_with_progress(lambda progress: convert(model, out, options, progress=progress),
                                show=not (quiet or as_json or dry_run))
    _print_result(result, quiet, as_json)
    return 0


def _run_with_progress(run, show: bool):
    """Run `run(progress)` with a rich bar on a terminal (stderr), none otherwise."""
    from rich.console import Console

    from qconvert.console import RichProgress

    console = Console(stderr=True)
    if not (show and console.is_terminal):
        return run(None)
    progress = RichProgress(console)
    try:
        return run(progress)
    finally:
        progress.stop()


def _print_result(result, quiet: bool, as_json: bool) -> None:
    import json

    from rich.console import Console

    from qconvert.console import print_convert_result

    if as_json:
        click.echo(json.dumps(result.summary(), indent=2))
    elif not quiet:
        print_convert_result(result, Console())


@cli.command(name="inspect")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON on stdout.")
def inspect_command(out: Path, as_json: bool) -> int:
    """Show a quantized folder: scheme, tensors, sizes, and whether its sha256 hashes still match.

    Exits 1 when a file no longer matches qconvert.json.
    """
    import json

    from rich.console import Console

    from qconvert.console import print_inspect_report
    from qconvert.inspection import inspect_checkpoint

    report = inspect_checkpoint(out)
    if as_json:
        click.echo(json.dumps(report.summary(), indent=2))
    else:
        print_inspect_report(report, Console())
    return 1 if report.hashes_ok is False else 0


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
