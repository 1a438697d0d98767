"""The scheme registry is the one home of a scheme: the CLI, the README and the code all follow it."""

from __future__ import annotations

import re
from pathlib import Path

from checkpoints import make_mixtral_checkpoint
from cli_helpers import run as run_cli
from cli_helpers import tree
from qconvert.schemes import NAMES, SCHEMES

ROOT = Path(__file__).resolve().parents[2]
# A comparison against a scheme or kind name: ==, != or `in` a literal name, either way round.
NAME = r"""["'](?:int8|int4|nf4|w8a8)["']"""
COMPARISON = re.compile(rf"""(?:==|!=|\bin)\s*\(?\s*{NAME}|{NAME}\s*(?:==|!=|\bin\b)""")
# Where names may be compared: the schemes themselves, the QArray kinds and the on-disk layouts.
ALLOWED = ("qconvert/schemes/", "formats/qarray.py", "formats/layout", "formats/compressed_tensors.py")


def test_the_readme_scheme_table_lists_the_registry_in_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \| .* \| (?:compressed-tensors|bitsandbytes)", readme, re.MULTILINE)
    assert tuple(rows) == NAMES


def test_quantize_help_lists_every_scheme_and_where_it_loads(capsys):
    code, out, _ = run_cli(["quantize", "--help"], capsys)
    text = " ".join(out.split()).replace("- ", "-")  # click wraps "compressed-tensors" at its hyphen
    assert code == 0
    for scheme in SCHEMES.values():
        assert f"{scheme.name}: {scheme.summary}, loads in {scheme.loads_in}" in text


def test_no_code_outside_the_schemes_and_layouts_compares_scheme_or_kind_names():
    hits = []
    for folder in ("qconvert", "formats", "kernels", "verify"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            hits += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
                     if COMPARISON.search(line)]
    assert hits == []


def test_static_w8a8_on_a_model_with_experts_is_refused_before_calibrating(tmp_path, capsys):
    source = make_mixtral_checkpoint(tmp_path / "src")
    before = tree(tmp_path)
    code, _, err = run_cli(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                            "--act", "static", "--calib", "random"], capsys)
    assert code == 2
    assert err.strip() == ("qconvert: error: --act static cannot serve this model's experts "
                           "(model.layers.0.block_sparse_moe.experts.0.w1, ...): vLLM's int8 fused-MoE kernel "
                           "takes only dynamic per-token activations; use --act dynamic (the default) for a "
                           "mixture-of-experts model")
    assert tree(tmp_path) == before
