"""pyproject.toml's pytest settings as a user runs them: `pytest -q` still ends with its summary line."""

import re
import subprocess
import sys
from pathlib import Path


def test_pytest_quiet_keeps_its_summary_line(tmp_path):
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(root / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0 and re.search(r"^1 passed in [\d.]+s", done.stdout, re.M), done.stdout
