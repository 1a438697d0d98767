"""The layers of docs/ARCHITECTURE.md, held: every import of every module, parsed, against the allowed graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {"formats": "qconvert.formats", "kernels": "qconvert.kernels", "verify": "qconvert.verify",
            "qconvert": "qconvert"}
# Layer -> the layers it may import (its own always), bottom to top: formats/ is the bottom; each stage of
# qconvert/ imports only the stages its data comes from; verify/ sits above the pipeline; the CLI on top.
ALLOWED = {
    "formats": set(),
    "kernels": {"formats"},
    "models": {"formats"},
    "ops": {"formats", "kernels"},
    "schemes": {"formats", "models"},
    "base": set(),  # progress, interrupts, stages: how every stage reports, stops and names itself
    "cluster": {"formats", "base"},  # a run of several processes: joining, the watch, what they share
    "source": {"formats", "models", "schemes", "base"},
    "calibration": {"formats", "models", "source", "base"},
    "write": {"formats", "base", "source"},  # source: upload.py reaches the Hub through source/hub.py's probe
    "options": {"formats", "schemes", "calibration", "write"},
    "methods": {"formats", "models", "schemes", "base", "cluster", "source", "calibration", "options"},
    "pipeline": {"formats", "kernels", "models", "ops", "schemes", "base", "cluster", "source", "calibration",
                 "write", "options", "methods"},
    "verify": {"formats", "kernels", "models", "ops", "schemes", "base", "cluster", "source", "calibration",
               "methods", "pipeline"},
    "examples": {"formats", "models"},  # example models built offline: qconvert's own forward, nothing above it
    "cli": {"formats", "kernels", "models", "ops", "schemes", "base", "cluster", "source", "calibration", "write",
            "options", "methods", "pipeline", "verify", "examples"},
}
# qconvert/'s own top-level modules, each named: a new one has to say where it stands.
TOP_LEVEL = {"qconvert": "base", "qconvert.progress": "base", "qconvert.interrupts": "base",
             "qconvert.stages": "base", "qconvert.options": "options", "qconvert.convert": "pipeline",
             "qconvert.calibrate": "pipeline", "qconvert.plan": "pipeline", "qconvert.inspection": "pipeline",
             "qconvert.loading": "pipeline"}
FOLDERS = ("formats", "kernels", "verify", "models", "ops", "schemes", "source", "calibration", "methods", "write",
           "cli", "cluster", "examples")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of a module, or of a name imported from one (`qconvert.options.ConvertOptions`)."""
    for folder in FOLDERS:
        if module == f"qconvert.{folder}" or module.startswith(f"qconvert.{folder}."):
            return folder
    for name in sorted(TOP_LEVEL, key=len, reverse=True):
        if name != "qconvert" and (module == name or module.startswith(name + ".")):
            return TOP_LEVEL[name]
    if module in ("qconvert", "qconvert.__version__"):
        return "base"
    raise AssertionError(f"{module} is in no layer: add it to TOP_LEVEL or move it into a stage's folder")


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


def test_qconvert_top_level_holds_only_the_named_modules():
    top = {module_name(p) for p in (ROOT / "qconvert").glob("*.py")}
    assert top == set(TOP_LEVEL)
    assert len(top) <= 10


def test_the_layers_have_no_cycle():
    order: list[str] = []
    remaining = dict(ALLOWED)
    while remaining:
        ready = sorted(name for name, below in remaining.items() if below <= set(order))
        assert ready, f"a cycle among {sorted(remaining)}"
        order += ready
        for name in ready:
            del remaining[name]
    assert order[-1] == "cli"


def violations(own: str, imports: list[tuple[int, str]]) -> list[str]:
    """The imports a module of layer `own` may not make."""
    return [f"line {line}: {target}" + ("" if target == "<relative import>" else f" ({layer_of(target)})")
            for line, target in imports
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
    assert len(violations("models", found)) == 3  # calibration, verify and a relative import
    assert violations("formats", found[:1]) == []
    assert len(violations("formats", [(1, "qconvert.kernels.plan")])) == 1
    assert violations("cli", found[:3]) == []
