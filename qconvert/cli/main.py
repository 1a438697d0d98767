"""The click face of qconvert: parses, prints, sets exit codes; no math lives here.

Exit codes (qconvert.formats.errors.EXIT_CODES, listed in every command's --help): 0
success; 1 a check failed; 2 usage errors; 3..9 the kinds of bad input in
qconvert.formats.errors; 70 an internal error; 129/130/143 interrupted by SIGHUP/SIGINT/SIGTERM.
"""

from __future__ import annotations

import sys

import click

from qconvert import __version__, interrupts
from qconvert.cli.calibrate import calibrate
from qconvert.cli import outcome
from qconvert.cli.common import EXIT_CODES_EPILOG, fail, is_leader
from qconvert.cli.inspect import example_model, inspect_command
from qconvert.cli.quantize import quantize
from qconvert.cli.streams import guard_stdout
from qconvert.cli.verify import verify_command
from qconvert.formats.errors import QConvertError, kernel_error_exit_code
from qconvert.formats.outside import shown
from qconvert.schemes import NAMES as SCHEME_NAMES
from qconvert.stages import DEBUG_VARIABLE, INTERNAL_ERROR_EXIT_CODE, internal_error_line, stage


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_EPILOG,
             invoke_without_command=True,
             help=f"Quantize Hugging Face checkpoints ({', '.join(SCHEME_NAMES)}) and verify the result.")
@click.version_option(__version__, prog_name="qconvert")
@click.pass_context
def cli(ctx: click.Context) -> None:
    # Its help is the registry's scheme names (qconvert.schemes.NAMES: no scheme module, no JAX, is imported).
    if ctx.invoked_subcommand is None:
        # Bare `qconvert` is a question, not a mistake: a short usage and the commands, exit 0 (as git does).
        click.echo(short_usage(ctx))



def short_usage(ctx: click.Context) -> str:
    """The usage line, one line per command and where the full help is."""
    group = ctx.command
    names = group.list_commands(ctx)
    width = max(map(len, names))
    lines = ["usage: qconvert [--version] [-h] COMMAND [ARGS]...", "", "commands:"]
    lines += [f"  {name:<{width}}  {group.get_command(ctx, name).get_short_help_str(limit=70)}" for name in names]
    lines += ["", "`qconvert COMMAND -h` shows a command's flags and exit codes."]
    return "\n".join(lines)



for _command in (quantize, calibrate, inspect_command, verify_command, example_model):
    cli.add_command(_command)


def _internal_error(err: Exception, command: str | None) -> None:
    import os

    from qconvert import cluster

    line = shown(internal_error_line(err, command or "qconvert"))
    if cluster.active():
        cluster.settle()
        cluster.note_failure(line.removeprefix("qconvert: "))

    if os.environ.get(DEBUG_VARIABLE, "").strip() not in ("", "0"):
        import traceback

        traceback.print_exception(err)
    outcome.say_failure(line.removeprefix("qconvert: "), INTERNAL_ERROR_EXIT_CODE, leader=is_leader(), line=line)
    sys.exit(INTERNAL_ERROR_EXIT_CODE)



def _fail_for(err: BaseException, command: str | None) -> None:
    signum = interrupts.received()
    if signum is not None:
        # Whatever surfaced (click's Abort, an ImportError wrapping the interrupt), a signal caused it.
        interrupted = interrupts.Interrupted(signum)
        if not interrupts.claim_exit():  # the watchdog has printed the line and is ending the process
            sys.exit(interrupted.exit_code)
        fail(interrupted.message, interrupted.exit_code)
    if isinstance(err, QConvertError):
        fail(str(err), err.exit_code)
    if kernel_error_exit_code(err) is not None:
        fail(str(err), kernel_error_exit_code(err))
    if isinstance(err, (KeyboardInterrupt, interrupts.Interrupted, click.exceptions.Abort)):
        fail(interrupts.message_for(err), interrupts.exit_code_for(err))
    if isinstance(err, click.ClickException):
        fail(err.format_message(), 2)
    if isinstance(err, OSError):
        fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), 9)
    if isinstance(err, Exception):  # anything unforeseen: one line and exit 70, never a traceback
        _internal_error(err, command)
    raise err



def _command_name(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else argv
    return next((a for a in args if a in cli.commands), None)



def _asks_json(argv: list[str], command: str | None) -> bool:
    """Whether the command, one that has --json, was given it (looked for in the words, so that a flag click
    refuses still gets its JSON document)."""
    if command is None or not any(p.name == "as_json" for p in cli.commands[command].params):
        return False
    return "--json" in argv[argv.index(command) + 1:]


def legacy_json_dash(args: list[str]) -> list[str]:
    """`verify --json -`, the earlier spelling of a plain `--json`, still works: the `-` is dropped."""
    return [a for i, a in enumerate(args) if not (a == "-" and i > 0 and args[i - 1] == "--json")]



def main(argv: list[str] | None = None) -> None:
    """Console entry point: every known failure becomes one line and an exit code."""
    guard_stdout()
    argv = legacy_json_dash(sys.argv[1:] if argv is None else list(argv))
    command = _command_name(argv)
    outcome.start(command if _asks_json(argv, command) else None)
    interrupts.set_sayer(lambda message, code: outcome.say_failure(message, code, leader=is_leader()))
    try:
        _run(argv, command)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        from qconvert import cluster

        if cluster.active():  # one of several processes: all leave with the run's code
            cluster.leave(code, _end_of_run)
        outcome.finish(code)
        raise


def _end_of_run(final: int, failure: str | None) -> None:
    """What a run of several processes says once its outcome is agreed: the failure that decided it, or this
    process's own result."""
    if failure is not None:
        outcome.say_failure(failure, final, leader=is_leader())
    else:
        outcome.finish(final)


def _run(argv: list[str], command: str | None) -> None:
    """Run the command; always ends in SystemExit with its exit code."""
    try:
        with stage(command or "qconvert"):
            exit_code = cli.main(args=argv, prog_name="qconvert", standalone_mode=False)
        interrupts.check()  # a signal that something swallowed still ends the run as interrupted
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure is one line and an exit code
        _fail_for(err, command)
    # A command may return its exit code (verify returns 1 when a check fails).
    sys.exit(exit_code if isinstance(exit_code, int) else 0)



if __name__ == "__main__":
    main()
