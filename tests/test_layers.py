"""The layers of docs/ARCHITECTURE.md, held: every import of every module, parsed, against the allowed graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"formats": "qconvert.formats", "kernels": "qconvert.kernels", "verify": "qconvert.verify",
            "qconvert": "qconvert"}
# Layer -> the layers it may import (its own always).
ALLOWED = {
    "formats": set(),
    "kernels": {"formats"},
    "models": {"formats"},
    "ops": {"formats", "kernels"},
    "pipeline": {"formats", "kernels", "models", "ops"},
    "verify": {"formats", "kernels", "models", "ops", "pipeline"},
    "cli": {"formats", "kernels", "models", "ops", "pipeline", "verify"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    for prefix in ("formats", "kernels", "verify", "models", "ops"):
        if module == f"qconvert.{prefix}" or module.startswith(f"qconvert.{prefix}."):
            return prefix
    if module in ("qconvert.cli.main", "qconvert.cli.entry"):
        return "cli"
    return "pipeline"  # the rest of qconvert/, schemes/ among it


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ours in the file, at any depth (lazy imports inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from qconvert import models` imports qconvert.models: each name is judged under its module.
            if node.module.split(".")[0] == "qconvert":
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "<relative import>"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "qconvert"]
    return sorted(found)


SOURCES = sorted(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py"))


def test_the_tree_is_what_the_graph_covers():
    assert len(SOURCES) > 80
    assert {layer_of(module_name(p)) for p in SOURCES} == set(ALLOWED)


def violations(own: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports a module of layer `own` may not make."""
    return [f"line {line}: {target} ({layer_of(target)})" for line, target in imports
            if target == "<relative import>" or (layer_of(target) != own and layer_of(target) not in ALLOWED[own])]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_module_imports_a_layer_above_its_own(path):
    own = layer_of(module_name(path))
    wrong = violations(own, imports_of(path))
    assert not wrong, f"{path.relative_to(ROOT)} ({own}) imports above itself: {'; '.join(wrong)}"


def test_the_checker_catches_imports_from_above_lazy_ones_too(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("from qconvert.formats.qarray import QArray\n"
                      "def f():\n    from qconvert.calibration.observer import iter_layer_stats\n"
                      "    import qconvert.verify.run\n"
                      "from . import sibling\n")
    found = imports_of(source)
    assert [t for _, t in found] == ["qconvert.formats.qarray.QArray", "qconvert.calibration.observer.iter_layer_stats",
                                     "qconvert.verify.run", "<relative import>"]
    assert len(violations("models", found)) == 3  # the pipeline, verify and a relative import
    assert violations("formats", found[:1]) == []
    assert len(violations("formats", [(1, "qconvert.kernels.plan")])) == 1
    assert violations("cli", found[:3]) == []
