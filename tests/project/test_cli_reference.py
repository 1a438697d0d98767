"""docs/CLI.md is what docs/cli_reference.py writes from the click command tree now, and the help texts and the
package's description name the scheme registry's schemes, all of them and no other."""

import importlib.util
import re
import tomllib
from pathlib import Path

import click
import pytest

from cli_helpers import run
from qconvert.cli.main import cli
from qconvert.schemes import NAMES, SCHEMES

ROOT = Path(__file__).resolve().parents[2]
# A word that reads as a scheme name (lower case, as the help texts and the CLI spell them).
SCHEME_WORD = re.compile(r"(?<![\w-])(?:int[48](?:-asym)?|w\d+a\d+(?:-fp8)?|fp8|nf4)(?![\w-])")


def schemes_named(text: str) -> set[str]:
    """The registry's schemes that `text` names, as whole words."""
    return {name for name in NAMES if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)}


def generator():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat(text: str) -> str:
    """Help text as one line: click wraps at spaces and after hyphens ("int4-" / "asym")."""
    return " ".join(text.split()).replace("- ", "-")


def test_cli_md_is_what_the_generator_writes_from_the_code_now():
    written = (ROOT / "docs" / "CLI.md").read_text(encoding="utf-8")
    assert written == generator().render(), "docs/CLI.md is out of date: run python docs/cli_reference.py"


def test_cli_md_has_every_command_and_every_flag_with_its_help():
    text = generator().render()
    root = click.Context(cli, info_name="qconvert", **cli.context_settings)
    for name, command in cli.commands.items():
        section = text[text.index(f"\n## qconvert {name}\n"):]
        section = section[:section.index("\n## ", 1)]
        ctx = click.Context(command, info_name=name, parent=root, **command.context_settings)
        for param in command.get_params(ctx):
            if isinstance(param, click.Option):
                row = next(line for line in section.splitlines() if line.startswith(f"| `{param.opts[0]}"))
                param.get_help_record(ctx)
                assert flat(param.help) in flat(row.replace("\\|", "|")), (name, param.opts)
    codes = text[text.index("## Exit codes"):]
    from qconvert.formats.errors import EXIT_CODES

    assert re.findall(r"^\| (\d+) \|", codes, re.M) == [str(code) for code, _ in EXIT_CODES]


def test_top_level_help_names_every_scheme_of_the_registry(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    assert schemes_named(flat(out)) == set(NAMES)
    assert set(SCHEME_WORD.findall(flat(out))) <= set(NAMES)


def test_the_package_description_names_every_scheme_of_the_registry():
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert schemes_named(description) == set(NAMES)
    assert set(SCHEME_WORD.findall(description)) <= set(NAMES)


def _help(command: str, flag: str) -> str:
    # With the commands' own settings, as docs/CLI.md is rendered: click caches the help option of the first.
    root = click.Context(cli, info_name="qconvert", **cli.context_settings)
    command = cli.commands[command]
    ctx = click.Context(command, parent=root, **command.context_settings)
    param = next(p for p in command.params if flag in getattr(p, "opts", ()))
    param.get_help_record(ctx)
    return flat(param.help)


@pytest.mark.parametrize(("flag", "named"), [
    ("--scheme", lambda s: True),
    ("--scale-search", lambda s: True),
    ("--gptq", lambda s: s.gptq_grid() is not None),
    ("--awq", lambda s: s.default_awq),
    ("--group-size", lambda s: s.takes_group_size),
    ("--any-architecture", lambda s: s.weight_only),
    ("--double-quant", lambda s: s.takes_double_quant),
    ("--kv-cache", lambda s: True),
])
def test_quantize_flag_helps_name_the_schemes_the_flag_concerns(flag, named):
    text = _help("quantize", flag)
    assert set(SCHEME_WORD.findall(text)) <= set(NAMES)
    assert {name for name, scheme in SCHEMES.items() if named(scheme)} <= schemes_named(text)


def _words(names: str) -> tuple[set[str], str]:
    """A flag cell as a set of names and what follows them, choices without click's brackets."""
    flags, _, value = names.replace("[", "").replace("]", "").partition(" ")
    while value.startswith("-"):  # "-q, --quiet": the names run on
        more, _, value = value.partition(" ")
        flags += " " + more
    return {name.strip(",") for name in flags.split()}, value


def test_each_flag_cell_names_the_value_as_help_shows_it():
    """The value's word is the one `--help` prints: qconvert's own flag types (WholeNumber: INTEGER, ByteSize:
    SIZE, RealNumber: NUMBER) once showed as TEXT here."""
    text = generator().render()
    root = click.Context(cli, info_name="qconvert", **cli.context_settings)
    for name in cli.list_commands(root):
        command = cli.get_command(root, name)
        ctx = click.Context(command, info_name=name, parent=root, **command.context_settings)
        section = text[text.index(f"\n## qconvert {name}\n"):]
        section = section[:section.index("\n## ", 1)]
        for param in command.get_params(ctx):
            if isinstance(param, click.Option) and not param.hidden and not param.is_eager:
                row = next(line for line in section.splitlines() if line.startswith(f"| `{param.opts[0]}"))
                cell = row.split("`")[1].replace("\\|", "|")
                assert _words(cell) == _words(param.get_help_record(ctx)[0]), (name, cell)
