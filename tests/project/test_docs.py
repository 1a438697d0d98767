"""The docs agree with the code: every table that lists the schemes lists the registry's, in its order, with what
the schemes themselves say; the exit-code table is the code's; no doc names a qconvert flag the CLI does not have;
and what the docs say `inspect` reads, it reads."""

import json
import re
from pathlib import Path

import click
import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly, run
from qconvert.cli.main import cli
from qconvert.formats.errors import EXIT_CODES
from qconvert.schemes import NAMES, SCHEMES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Flags of other programs that the docs name, each with its owner; any other `--flag` must be qconvert's.
FOREIGN_FLAGS = {
    "--no-deps": "pip", "--index-url": "pip", "--kv-cache-dtype": "vllm serve",
    "--xla_force_host_platform_device_count": "XLA_FLAGS", "--private": "hf upload", "--shape": "bench/verify.py",
    "--tpu": "bench/vllm_check.py", "--check": "bench/scaling_model.py", "--command": "gcloud",
    "--nodes": "srun", "--ntasks-per-node": "srun", "--worker": "gcloud", "--compare": "bench/convert_matrix.py",
}
# The pages a reader looks things up in (docs/ACCURACY.md and docs/BENCHMARKS.md are records of measurements).
PAGES = ["README.md", *(f"docs/{name}" for name in (
    "CLI.md", "COMMANDS.md", "METHODS.md", "LOADERS.md", "EXIT_CODES.md", "JSON.md", "SCALING.md", "FORMATS.md",
    "JAX.md", "TESTING.md", "TRANSCRIPT.md", "ARCHITECTURE.md"))]


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    part = text[text.index(heading):]
    end = part.find("\n## ", len(heading))
    return part if end < 0 else part[:end]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table under `header` (its first line); a generator's end marker
    after it (an HTML comment) is no row."""
    table = text[text.index(header):]
    table = table[:table.index("\n\n")] if "\n\n" in table else table
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table.splitlines()[2:]
            if line.startswith("|")]


def test_the_loaders_table_lists_the_registry_in_order():
    rows = table_rows(read("docs/LOADERS.md"), "| scheme | what it writes |")
    assert tuple(row[0].strip("`") for row in rows) == NAMES


def test_json_md_names_every_scheme_value_and_no_other():
    (row,) = [row for row in table_rows(read("docs/JSON.md"), "| field | in | meaning |") if row[0] == "`scheme`"]
    assert set(re.findall(r"`([\w-]+)`", row[2])) == set(NAMES)


def test_the_methods_defaults_table_is_what_each_scheme_does_by_default():
    rows = table_rows(read("docs/METHODS.md"), "| scheme | by default | fast path |")
    assert tuple(row[0].strip("`") for row in rows) == NAMES
    for row in rows:
        scheme, default = SCHEMES[row[0].strip("`")], row[1]
        assert ("AWQ" in default) == scheme.default_awq, row
        assert ("GPTQ" in default) == scheme.default_gptq, row
        assert ("SmoothQuant" in default) == scheme.calibrates, row
        calibrates = scheme.calibrates or scheme.calibrated_inputs or scheme.default_gptq or scheme.default_awq
        assert ("no calibration" in default) == (not calibrates), row


def test_the_scale_search_table_has_every_scheme():
    rows = table_rows(read("docs/METHODS.md"), "| scheme | what is searched | error minimised |")
    assert {row[0].strip("`").split()[0] for row in rows} == set(NAMES)


def test_the_verify_thresholds_table_is_each_schemes_own():
    rows = table_rows(read("docs/COMMANDS.md"), "| scheme | min layer SQNR |")
    expected = []
    for name, scheme in SCHEMES.items():
        expected.append((f"`{name}`", scheme.thresholds))
        if scheme.static_thresholds is not None:
            expected.append((f"`{name} --act static`", scheme.static_thresholds))
    assert [row[0] for row in rows] == [label for label, _ in expected]
    fields = ("min_layer_sqnr_db", "min_layer_cosine", "max_mean_kl", "min_top1_agreement", "max_perplexity_ratio",
              "min_pooled_cosine", "min_fidelity_sqnr_db")
    for row, (label, thresholds) in zip(rows, expected):
        shown = [float(cell.removesuffix(" dB")) for cell in row[1:]]
        assert shown == [getattr(thresholds, field) for field in fields], label


def test_the_exit_code_table_is_the_codes():
    rows = table_rows(read("docs/EXIT_CODES.md"), "| code | meaning |")
    assert [(int(code), meaning.replace("`", "")) for code, meaning in rows] == list(EXIT_CODES)


def _qconvert_flags() -> set[str]:
    # Each context with its command's own settings (-h as well as --help), as the command line builds it: click
    # caches a command's help option from whichever context is built first, and docs/CLI.md is rendered with them.
    root = click.Context(cli, info_name="qconvert", **cli.context_settings)
    flags = set()
    for command in [cli, *cli.commands.values()]:
        for param in command.get_params(click.Context(command, parent=root, **command.context_settings)):
            flags |= {*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())}
    return {flag for flag in flags if flag.startswith("--")}


@pytest.mark.parametrize("page", PAGES)
def test_no_page_names_a_flag_qconvert_does_not_have(page):
    named = set(re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", read(page)))
    assert named - _qconvert_flags() - set(FOREIGN_FLAGS) == set()


def test_the_readme_links_every_page_and_every_page_is_there():
    readme = read("README.md")
    linked = set(re.findall(r"docs/([A-Z_]+\.md)", readme))
    assert {Path(page).name for page in PAGES[1:]} | {"ACCURACY.md", "BENCHMARKS.md"} <= linked
    assert all((DOCS / name).is_file() for name in linked)


def test_the_docs_say_inspect_reads_every_scheme_and_it_reads_4_bit_and_grouped_folders(tmp_path, capsys):
    text = section(read("docs/COMMANDS.md"), "## qconvert inspect")
    reads = text[text.index("It reads a folder of every scheme"):]
    assert set(re.findall(r"`([\w-]+)`", reads[:reads.index(", grouped")])) == set(NAMES)
    assert "4-bit" not in text  # what the docs once said inspect refused
    source = make_llama_checkpoint(tmp_path / "src")
    for scheme, flags in (("int4", ["--no-awq", "--no-gptq", "--group-size", "32"]),
                          ("int4-asym", ["--no-awq", "--no-gptq"]), ("nf4", []),
                          ("w4a8-fp8", ["--no-awq", "--no-gptq"])):
        out = quantize_quietly(source, tmp_path / scheme, "--scheme", scheme, *flags)
        code, shown, err = run(["inspect", str(out), "--json"], capsys)
        assert code == 0, err
        assert json.loads(shown)["scheme"] == scheme
