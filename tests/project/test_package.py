"""One version, set in qconvert/__init__.py: the package's metadata, `qconvert --version` and the changelog's
newest entry all say it. The built package (slow: opt in with QCONVERT_PACKAGE_CHECK=1) holds its data files and
converts offline (tests/package_check.sh)."""

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import qconvert

ROOT = Path(__file__).resolve().parents[2]
QCONVERT = str(Path(sys.executable).parent / "qconvert")


def test_qconvert_version_prints_the_package_metadata_version():
    done = subprocess.run([QCONVERT, "--version"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    installed = metadata.version("qconvert")
    assert installed == qconvert.__version__, "the installed metadata is stale: reinstall (pip install -e .)"
    assert done.stdout == f"qconvert, version {installed}\n"


def test_the_version_is_set_in_one_place_and_the_changelog_has_its_entry():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qconvert.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", qconvert.__version__)
    entries = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert entries and entries[0] == qconvert.__version__, "CHANGELOG.md needs an entry for this version, first"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QCONVERT_PACKAGE_CHECK") != "1",
                    reason="builds the wheel and sdist and installs each in a fresh venv (minutes); "
                           "QCONVERT_PACKAGE_CHECK=1 runs it")
@pytest.mark.timeout(1800)
def test_the_built_wheel_and_sdist_install_and_convert_offline():
    done = subprocess.run(["bash", str(ROOT / "tests" / "package_check.sh"), sys.executable], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for kind in ("wheel", "sdist"):
        assert f"package_check: {kind} installs and converts, inspects and verifies the example offline" in \
            done.stdout
