"""Write docs/CLI.md from the click command tree itself: every command, every flag, its help and its default.

    python docs/cli_reference.py           # rewrite docs/CLI.md
    python docs/cli_reference.py --check   # exit 1 if docs/CLI.md differs from what the code gives now

The help texts are the ones `qconvert COMMAND --help` prints (flags whose help names schemes write it from the
scheme registry when asked), the exit codes qconvert.formats.errors.EXIT_CODES. tests/project/test_cli_reference.py
fails when the file is out of date.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import click

TARGET = Path(__file__).resolve().parent / "CLI.md"


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(param: click.Parameter, ctx: click.Context) -> str:
    """The flag's default as a user meets it; '' where the help says what decides it (None, an empty list)."""
    if param.is_eager:  # --help, --version
        return ""
    default = param.get_default(ctx, call=False)
    if isinstance(param, click.Option) and param.is_flag:
        return "" if default is None else ("on" if default is True else "off")
    if not isinstance(default, (str, int, float)) or isinstance(default, bool):  # None, (), click's unset marker
        return ""
    return f"`{default}`"


def _value(param: click.Option) -> str:
    """What follows the flag: its metavar, its choices, or its type's name as `--help` shows it (INTEGER, PATH,
    SIZE: the name of click's type or of qconvert's own, qconvert.cli.flag_types)."""
    if param.is_flag:
        return ""
    if param.metavar:
        return f" {param.metavar}"
    if isinstance(param.type, click.Choice):
        return " " + "|".join(map(str, param.type.choices))
    return " " + param.type.name.upper()


def _names(param: click.Option) -> str:
    names = ", ".join(param.opts) + _value(param)
    return f"{names} / {', '.join(param.secondary_opts)}" if param.secondary_opts else names


def _options_table(command: click.Command, ctx: click.Context) -> list[str]:
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for param in command.get_params(ctx):
        if not isinstance(param, click.Option) or param.hidden:
            continue
        param.get_help_record(ctx)  # writes the help texts built when help is shown (from the scheme registry)
        help_text = param.help or ""
        if param.required:
            help_text = f"Required. {help_text}"
        rows.append(f"| `{_cell(_names(param))}` | {_cell(_default(param, ctx))} | {_cell(help_text)} |")
    return rows


def _section(command: click.Command, ctx: click.Context, level: str) -> list[str]:
    path = ctx.command_path
    usage = " ".join([path, *command.collect_usage_pieces(ctx)])
    lines = [f"{level} {path}", "", f"    {usage}", ""]
    if command.help:
        lines += [inspect.cleandoc(command.help), ""]
    arguments = [p.human_readable_name for p in command.get_params(ctx) if isinstance(p, click.Argument)]
    if arguments:
        lines += ["Arguments: " + ", ".join(f"`{name}`" for name in arguments) + ".", ""]
    lines += [*_options_table(command, ctx), ""]
    return lines


def render() -> str:
    """docs/CLI.md as the code gives it now."""
    from qconvert.cli.main import cli
    from qconvert.formats.errors import EXIT_CODES

    # With the command's own context settings (-h as well as --help), as the real command line builds it:
    # click caches a command's help option from whichever context is built first.
    root = click.Context(cli, info_name="qconvert", **cli.context_settings)
    names = cli.list_commands(root)
    lines = [
        "# Command-line reference",
        "",
        "Written from the click command tree (`qconvert.cli.main.cli`) by `python docs/cli_reference.py`; do not",
        "edit it by hand: `tests/project/test_cli_reference.py` fails when it differs from what the code gives.",
        "Each command's `--help` prints the same text.",
        "",
        "Commands: " + ", ".join(f"[`{name}`](#qconvert-{name})" for name in names)
        + "; [exit codes](#exit-codes).",
        "",
        *_section(cli, root, "##"),
    ]
    for name in names:
        command = cli.get_command(root, name)
        lines += _section(command, click.Context(command, info_name=name, parent=root, **command.context_settings),
                          "##")
    lines += ["## Exit codes", "",
              "Every command's `--help` ends with this table (`qconvert.formats.errors.EXIT_CODES`); "
              "docs/EXIT_CODES.md",
              "says what a failure prints and what `--json` gives.", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {_cell(meaning)} |" for code, meaning in EXIT_CODES]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if TARGET.read_text(encoding="utf-8") != text:
            print(f"{TARGET} is out of date: run python docs/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    TARGET.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
