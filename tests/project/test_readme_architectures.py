"""README.md's list of supported architectures is the family registry's, so the two cannot drift."""

import re
from pathlib import Path

from qconvert.models.registry import supported_architectures

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_architectures() -> list[str]:
    """The `Names` in README's 'Supported architectures:' paragraph, before the first ';'."""
    text = README.read_text(encoding="utf-8")
    start = text.index("Supported architectures:")
    paragraph = text[start:text.index("\n\n", start)]
    return sorted(re.findall(r"`([A-Za-z0-9]+)`", paragraph.split(";")[0]))


def test_readme_lists_exactly_the_registry_architectures():
    assert readme_architectures() == supported_architectures()
