"""MODEL and OUT paths that cannot work, and names the terminal cannot show: one line each, its own exit code,
before any long work."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly, run

QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("paths") / "model")


@pytest.mark.parametrize("command", [["quantize", "", "-o", "{out}"], ["calibrate", "", "-o", "{out}/s.safetensors"]],
                         ids=["quantize", "calibrate"])
def test_an_empty_model_is_exit_2_not_the_current_folder(model, tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(model)  # a model lies in the current folder: '' must not mean it
    args = [a.format(out=tmp_path / "out") for a in command]
    assert run(args, capsys) == (2, "", "qconvert: error: MODEL is empty; give a folder holding config.json and "
                                        "the safetensors, or a Hub id (owner/name)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["loop", "nested/loop", "dangling"])
def test_a_symlink_that_leads_nowhere_is_model_not_found_not_the_hub(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nested").mkdir()
    for folder in (tmp_path, tmp_path / "nested"):
        os.symlink("other", folder / "loop")
        os.symlink("loop", folder / "other")
    os.symlink("missing", tmp_path / "dangling")
    assert run(["quantize", name, "-o", str(tmp_path / "out")], capsys) == (
        3, "", f"qconvert: error: {name} is a symbolic link that leads nowhere (a loop, or a target that does not "
               "exist); give the model's folder itself\n")


def test_an_out_name_as_long_as_the_file_system_takes_is_written(model, tmp_path, capsys):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    out = tmp_path / ("o" * name_max)  # its temporaries' names are bounded to fit beside it
    assert run(["quantize", str(model), "-o", str(out), "-q"], capsys) == (0, "", "")
    assert list(tmp_path.iterdir()) == [out]


def test_a_non_ascii_folder_under_an_ascii_terminal_is_shown_escaped(model, tmp_path):
    folder = quantize_quietly(model, tmp_path / "int8")
    shown = tmp_path / "dossier-été"
    shutil.copytree(folder, shown)
    env = dict(os.environ, PYTHONIOENCODING="ascii")
    done = subprocess.run([QCONVERT, "inspect", str(shown)], capture_output=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert b"dossier-\\xe9t\\xe9" in done.stdout and done.stderr == b""
