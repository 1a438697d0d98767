"""Write the schemes tables of README.md and docs/LOADERS.md from the servers table and the scheme registry.

    python docs/servers_table.py           # rewrite the tables in README.md and docs/LOADERS.md
    python docs/servers_table.py --check   # exit 1 if either differs from what the code gives now

Each table sits between a begin and an end marker (HTML comments, which Markdown does not show); the text around
it is written by hand. The rows are the registry's schemes (qconvert.schemes.NAMES, with DESCRIPTIONS' words);
the server cells are what qconvert/schemes/servers.py records, the same cells `qconvert inspect` prints for a
folder and its model card writes. tests/project/test_servers_table.py fails when a table is out of date.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMES_TABLE = "schemes table"  # README.md and docs/LOADERS.md: one row per scheme
CELLS_TABLE = "servers cells"  # docs/LOADERS.md: every cell of the servers table, by scheme, flags and family
TARGETS = {"README.md": (SCHEMES_TABLE,), "docs/LOADERS.md": (SCHEMES_TABLE, CELLS_TABLE)}


def begin(name: str) -> str:
    return f"<!-- {name}: written by docs/servers_table.py from qconvert/schemes/servers.py -->"


def end(name: str) -> str:
    return f"<!-- {name}: end -->"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def schemes_table() -> list[str]:
    """One row per scheme: what it writes, its layout, and each server's answer over the families measured."""
    from qconvert.schemes import DESCRIPTIONS, NAMES
    from qconvert.schemes.servers import LAYOUTS, SERVERS, TITLES, scheme_cell

    lines = ["| scheme | what it writes | layout | " + " | ".join(TITLES[s] for s in SERVERS) + " |",
             "|" + "---|" * (3 + len(SERVERS))]
    for name in NAMES:
        cells = [f"`{name}`", DESCRIPTIONS[name][0], LAYOUTS[name], *(scheme_cell(name, s) for s in SERVERS)]
        lines.append("| " + " | ".join(map(_cell, cells)) + " |")
    return lines


def cells_table() -> list[str]:
    """Every measured cell: one row per scheme (with the flags that change where it loads) and model family."""
    from qconvert.schemes import NAMES
    from qconvert.schemes.servers import FAMILIES, SERVERS, TABLE, TITLES, flags_of, servers

    lines = ["| scheme and flags | family | " + " | ".join(TITLES[s] for s in SERVERS) + " |",
             "|" + "---|" * (2 + len(SERVERS))]
    keys = sorted(dict.fromkeys(key for key, _ in TABLE),  # each scheme's own key first, then its variants
                  key=lambda key: (NAMES.index(flags_of(key)[0]), flags_of(key)[1] != ""))
    rows = [(key, family) for key in keys for family in FAMILIES if (key, family) in TABLE]
    for key, family in rows:
        scheme, flags = flags_of(key)
        answers = servers(key, family)
        lines.append("| " + " | ".join(map(_cell, [f"`{scheme}{' ' + flags if flags else ''}`", FAMILIES[family],
                                                   *(answers[s] for s in SERVERS)])) + " |")
    return lines


TABLES = {SCHEMES_TABLE: schemes_table, CELLS_TABLE: cells_table}


def rewrite(text: str, names: tuple[str, ...]) -> str:
    """`text` with each named table's lines between its markers replaced by what the code gives now."""
    for name in names:
        start, stop = text.find(begin(name)), text.find(end(name))
        if start < 0 or stop < start:
            raise ValueError(f"no {begin(name)!r} ... {end(name)!r} markers")
        text = text[:start] + "\n".join([begin(name), *TABLES[name](), end(name)]) + text[stop + len(end(name)):]
    return text


def main(argv: list[str]) -> int:
    if argv[1:] not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for target, names in TARGETS.items():
        path = ROOT / target
        text = path.read_text(encoding="utf-8")
        try:
            written = rewrite(text, names)
        except ValueError as err:
            print(f"{target}: {err}", file=sys.stderr)
            return 1
        if written != text:
            stale.append(target)
            if not argv[1:]:
                path.write_text(written, encoding="utf-8")
    if stale and argv[1:]:
        print(f"{', '.join(stale)} out of date: run python docs/servers_table.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
