"""What the commands share: the exit-code epilog, the output and calibration flags, progress on stderr, the
one-line failure, and the checks every command makes before it starts JAX or the Hub."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from qconvert.cli.flag_types import Text, WholeNumber
from qconvert.cli import outcome
from qconvert.formats.errors import EXIT_CODES
from qconvert.formats.outside import shown

# Every command's --help ends with the same exit-code table as docs/EXIT_CODES.md.
EXIT_CODES_EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)



def out_path(ctx, param, value):
    """-o must name something: an empty string would silently mean the current folder."""
    del ctx
    if value is not None and not str(value).strip():
        raise click.BadParameter("is empty; name the output to write", param=param)
    return None if value is None else Path(value)



def verbose_option(command):
    return click.option("--verbose", is_flag=True,
                        help="Also show huggingface_hub's own messages (retries, warnings) on stderr.")(command)



def print_document(command: str, body: dict, exit_code: int = 0, error: str | None = None) -> None:
    """A command's --json document (qconvert.cli.outcome holds it until the run's outcome is final)."""
    outcome.hold_document(command, body, exit_code, error)


note_out = outcome.note_out
record_failures = outcome.record_failures


def check_model(model: str) -> None:
    """MODEL refused from its words alone (empty, a file, a path that is not there), before JAX is imported."""
    from qconvert.source.hub import check_model_argument

    check_model_argument(model)


def fail(message: str, exit_code: int) -> None:
    """Print one line on stderr and exit (in a run of several processes, after the watch has had its say: a
    failure here that is the echo of another process's ends this process with that one's line). A command given
    --json prints its error document on stdout first."""
    from qconvert import cluster

    message = shown(message)  # names, paths and values from outside may carry escapes or line breaks
    if cluster.active():
        cluster.settle()
        cluster.note_failure(message)
    outcome.say_failure(message, exit_code, leader=is_leader())
    sys.exit(exit_code)



def with_options(command, options):
    for option in reversed(options):
        command = option(command)
    return command



def calibration_options(command):
    """The calibration text flags, the same on `quantize` (w8a8) and `calibrate`."""
    return with_options(command, [
        click.option("--calib", type=Text(), default=None, metavar="SOURCE",
                     help="Calibration text: builtin (the default: a small English corpus shipped with "
                          "qconvert, works offline), FILE.txt, FILE.jsonl (a \"text\" field), "
                          "hf://datasets/OWNER/NAME[@REV] (a whole Hub dataset: parquet, JSON, CSV or text files, "
                          "found by split as the datasets library finds them), hf://datasets/OWNER/NAME[@REV]/FILE, "
                          "or random (random token ids)."),
        click.option("--calib-samples", type=WholeNumber(1, 10**12), default=None,
                     help="Calibration windows (default 128; fewer when the text runs out)."),
        click.option("--calib-seqlen", type=WholeNumber(2, 10**12), default=None,
                     help="Tokens per window (default 512, capped at the model's positions)."),
        click.option("--calib-split", type=Text(), default=None, metavar="SPLIT",
                     help="A whole Hub dataset's split to read (default train)."),
        click.option("--calib-column", type=Text(), default=None, metavar="COLUMN",
                     help="A whole Hub dataset's column to read (default: text, else messages, else "
                          "conversations). A column of conversations ([{role, content}, ...]) is written as text "
                          "with the model's own chat template."),
        click.option("--calib-config", type=Text(), default=None, metavar="NAME",
                     help="A whole Hub dataset's config (its README's configs; default: the default one)."),
        click.option("--shard-experts", type=click.Choice(list(SHARD_EXPERTS)), default=None,
                     help="Split each MoE layer's experts over the devices while calibrating (each device holds "
                          "its own whole experts and their Hessians): auto (the default) where a layer with every "
                          "expert does not fit one device, always, or never. Split, the statistics differ from "
                          "one device's by float32 rounding."),
    ])


# --shard-experts: what each choice passes on (None: calibration decides by the memory estimate).
SHARD_EXPERTS = {"auto": None, "always": True, "never": False}


def shard_experts_choice(value: str | None) -> bool | None:
    """--shard-experts as calibration takes it."""
    return SHARD_EXPERTS[value or "auto"]



def cluster_options(command):
    """The flags of a plain launch of several processes (launchers that set JAX's environment need none)."""
    return with_options(command, [
        click.option("--coordinator", type=Text(), default=None, metavar="HOST:PORT",
                     help="A run of several processes: process 0's host and a free port, the same on every process."),
        click.option("--num-processes", type=WholeNumber(1, 2**16), default=None, metavar="N",
                     help="A run of several processes: how many."),
        click.option("--process-id", type=WholeNumber(0, 2**16 - 1), default=None, metavar="I",
                     help="A run of several processes: this one's index, 0..N-1 (0 writes the output)."),
        click.option("--cluster", "detect_cluster", is_flag=True,
                     help="A run of several processes launched by a TPU pod slice, SLURM, MPI or Kubernetes: "
                          "join as JAX detects them (without it, qconvert joins where the launcher's environment "
                          "says there are several processes)."),
    ])


def join_cluster(flags: dict) -> None:
    """Join the run's other processes where launched as several (before JAX starts): from the flags, or from the
    launcher's environment (a TPU pod slice, SLURM, Open MPI, JAX_COORDINATOR_ADDRESS). One process: nothing."""
    from qconvert import cluster
    from qconvert.cli.streams import native_output_silenced

    cluster.start(cluster.Launch(flags.pop("coordinator", None), flags.pop("num_processes", None),
                                 flags.pop("process_id", None), flags.pop("detect_cluster", False)),
                  before_joining=native_output_silenced)


def is_leader() -> bool:
    """Whether this process prints and writes (the only one, or process 0 of several)."""
    from qconvert import cluster

    return cluster.is_leader()


def run_with_progress(run, silent: bool, write_bar: bool = False):
    """Run `run(stages, write_progress)`: on a terminal, rich bars on stderr (a bar per stage, and the write
    bar); in a pipe or log, plain lines on stderr and no bar; nothing at all when `silent`."""
    from rich.console import Console

    from qconvert.cli.console import RichProgress, RichStages
    from qconvert.progress import SILENT, Lines

    console = Console(stderr=True)
    if silent:
        return run(SILENT, None)
    # Colour may be forced (FORCE_COLOR: rich reads it); redrawing bars is for terminals only, never a log.
    if not _stream_is_terminal(sys.stderr):
        return run(Lines(lambda text: click.echo(f"qconvert: {shown(text)}", err=True)), None)
    stages = RichStages(console)
    progress = RichProgress(console, stages) if write_bar else None
    try:
        return run(stages, progress)
    finally:
        stages.stop()
        if progress is not None:
            progress.stop()



def _stream_is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # replaced or closed
        return False


def check_jax_platforms() -> None:
    """Refuse a JAX_PLATFORMS this machine cannot start, before anything is read or written."""
    from qconvert.cli import jax_platform

    jax_platform.check_jax_platforms()


def hub_messages(verbose: bool) -> None:
    """huggingface_hub's own retry lines and warnings stay off stderr unless --verbose."""
    import os

    from qconvert.formats.errors import UsageError
    from qconvert.formats.outside import OutsideValueError, hub_environment
    from qconvert.source.hub import quiet_hub_logging

    try:
        hub_environment(os.environ)  # the Hub's variables, before huggingface_hub reads them as it loads
    except OutsideValueError as err:
        raise UsageError(f"{err}; fix or unset it") from None
    quiet_hub_logging(not verbose)



# verify's --backend choices as the CLI lists them without importing the kernels (and JAX): the names of
# qconvert.kernels.backends.deployment_backends(), which a test holds them to.
VERIFY_BACKENDS = ("auto", "tpu", "gpu", "cpu", "xla")


BACKEND_CHOICE = click.Choice(VERIFY_BACKENDS)
