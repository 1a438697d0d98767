"""The schemes tables of README.md and docs/LOADERS.md are what docs/servers_table.py writes now from the servers
table (qconvert/schemes/servers.py) and the scheme registry: a scheme added to the registry, or a cell changed,
fails here until the docs are written again; and the servers table names only the registry's schemes."""

import importlib.util
import re
from pathlib import Path

import pytest

import qconvert.schemes
from qconvert.schemes import NAMES, SCHEMES
from qconvert.schemes import servers as table

ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("servers_table", ROOT / "docs" / "servers_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows_between(text: str, name: str) -> list[list[str]]:
    """The cells of each row of the table between the generator's markers `name`, header and rule left out."""
    module = generator()
    part = text[text.index(module.begin(name)):text.index(module.end(name))]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in part.splitlines()[3:]]


@pytest.mark.parametrize("target", ["README.md", "docs/LOADERS.md"])
def test_the_tables_are_what_the_generator_writes_from_the_code_now(target):
    module = generator()
    text = (ROOT / target).read_text(encoding="utf-8")
    assert module.rewrite(text, module.TARGETS[target]) == text, \
        f"{target} is out of date: run python docs/servers_table.py"


@pytest.mark.parametrize("target", ["README.md", "docs/LOADERS.md"])
def test_each_schemes_table_has_the_registrys_schemes_in_order(target):
    rows = rows_between((ROOT / target).read_text(encoding="utf-8"), generator().SCHEMES_TABLE)
    assert tuple(row[0].strip("`") for row in rows) == NAMES


def test_the_cells_table_has_every_cell_of_the_servers_table():
    rows = rows_between((ROOT / "docs/LOADERS.md").read_text(encoding="utf-8"), generator().CELLS_TABLE)
    families = {name: family for family, name in table.FAMILIES.items()}
    shown = {}
    for row in rows:
        scheme, _, flags = row[0].strip("`").partition(" ")
        keys = [key for key, _ in table.TABLE if table.flags_of(key) == (scheme, flags)]
        shown[(keys[0], families[row[1]])] = row[2:]
    assert shown.keys() == table.TABLE.keys()
    # Each cell as written by hand in the table (Y, N, ?), read back from the doc.
    letters = {"yes": "Y", "no": "N", "not measured": "?"}
    assert {key: "".join(letters[cell] for cell in cells) for key, cells in shown.items()} == table.TABLE


def test_a_scheme_added_to_the_registry_but_not_to_the_docs_fails_the_check(monkeypatch, capsys):
    module = generator()
    assert module.main(["servers_table.py", "--check"]) == 0
    monkeypatch.setattr(qconvert.schemes, "NAMES", (*NAMES, "int2"))
    monkeypatch.setitem(qconvert.schemes.DESCRIPTIONS, "int2", ("int2 weights", "nowhere"))
    monkeypatch.setitem(table.LAYOUTS, "int2", "compressed-tensors `pack-quantized`, 2 bits")
    assert module.main(["servers_table.py", "--check"]) == 1
    assert "README.md, docs/LOADERS.md out of date" in capsys.readouterr().err


def test_the_servers_table_names_only_registry_schemes_known_families_and_servers():
    assert table.LAYOUTS.keys() == set(NAMES)
    assert {table.flags_of(key)[0] for key, _ in table.TABLE} <= set(NAMES)
    assert {family for _, family in table.TABLE} <= table.FAMILIES.keys()
    assert all(len(cells) == len(table.SERVERS) and set(cells) <= set("YN?") for cells in table.TABLE.values())
    assert {scheme for scheme, _ in table.NOTES} <= set(NAMES)
    assert {server for _, server in table.NOTES} <= set(table.SERVERS) == table.TITLES.keys()


@pytest.mark.parametrize("name", NAMES)
def test_each_layout_cell_names_the_quant_method_and_format_the_scheme_writes(name):
    scheme = SCHEMES[name]
    flags = scheme.layout_flags(group_size=128 if scheme.takes_group_size else None, shapes={"x": (256, 256)})
    config = scheme.layout.quantization_config(flags, (), "float32")
    assert table.LAYOUTS[name].startswith(config["quant_method"])
    if "format" in config:
        assert f"`{config['format']}`" in table.LAYOUTS[name]


def test_a_cell_says_yes_or_no_where_the_families_agree_and_names_them_where_not():
    # Hand-read from TABLE: int8 on vLLM GPU is Y for every family measured; w8a8 on vLLM TPU's default path is Y
    # for Gemma 3 alone; int4 on vLLM TPU is N by default, Y for Qwen3 at group 64.
    assert table.scheme_cell("int8", "vLLM GPU") == "yes"
    assert table.scheme_cell("w8a8", "vLLM TPU").startswith(
        "yes (Gemma 3), no (Llama, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3); with `--act static`: no (")
    assert table.scheme_cell("int4", "vLLM TPU").startswith("no; with `--group-size 64`: yes (Qwen3);")
    assert table.scheme_cell("nf4", "vLLM TPU") == "not measured"


@pytest.mark.parametrize("name", NAMES)
def test_each_loader_the_scheme_help_names_loads_it_somewhere_in_the_table(name):
    """`quantize --help` (DESCRIPTIONS' second words) names loaders; each must load some folder of the scheme in the
    servers table (vLLM TPU on either of its paths)."""
    from qconvert.schemes import DESCRIPTIONS

    columns = {"vLLM TPU": (1, 2), "vLLM": (0,), "transformers": (3,)}
    named = [loader.strip() for loader in re.sub(r"\s*\([^)]*\)", "", DESCRIPTIONS[name][1]).split(",")]
    assert named and all(loader.startswith(tuple(columns)) for loader in named), named
    for loader in named:
        column = next(columns[word] for word in columns if loader.startswith(word))
        cells = [cells for (key, _), cells in table.TABLE.items() if table.flags_of(key)[0] == name]
        assert any(row[i] == "Y" for row in cells for i in column), (name, loader)
