"""verify --update-card and --json-file into a place that cannot take the file: refused before the check runs
(exit 9, one line naming the file and why, no verdict), never after a PASS."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly, run, tree


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("replaceable")
    return quantize_quietly(make_llama_checkpoint(root / "src"), root / "out")


@contextlib.contextmanager
def attribute(path: Path, flag: str):
    """chattr +FLAG on `path` for the block (skipped where the file system or the user cannot set it)."""
    done = subprocess.run(["chattr", f"+{flag}", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +{flag} is not available here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", f"-{flag}", str(path)], check=True)


@contextlib.contextmanager
def bind_mounted(source: Path, target: Path):
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"a bind mount is not available here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


def _refused_first(args, capsys, root: Path, words: str) -> None:
    before = tree(root)
    code, stdout, stderr = run(["verify", *args, "--quick", "--json"], capsys)
    assert code == 9, stderr
    line = f"cannot write {words}; choose a place you can write to, before anything is computed"
    assert stderr == f"qconvert: error: {line}\n"  # no verdict, no progress: nothing ran
    document = json.loads(stdout)
    assert (document["exit_code"], document["error"], document["passed"]) == (9, line, False)
    assert document["verdict"].startswith("ERROR ")
    assert tree(root) == before


@pytest.mark.parametrize("name", ["README.md", "qconvert.json"])
def test_update_card_over_an_immutable_file_is_refused_first(converted, tmp_path, capsys, name):
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    with attribute(out / name, "i"):
        _refused_first([str(out), "--update-card"], capsys, tmp_path,
                       f"the model card's verification section: {out / name} is immutable (chattr +i), so "
                       f"{name} cannot be replaced there")


def test_update_card_in_an_append_only_folder_is_refused_first(converted, tmp_path, capsys):
    out = Path(shutil.copytree(converted, tmp_path / "out"))
    with attribute(out, "a"):
        _refused_first([str(out), "--update-card"], capsys, tmp_path,
                       f"the model card's verification section: {out} is append-only (chattr +a), so README.md "
                       "cannot be replaced there")


def test_json_file_over_an_immutable_record_is_refused_first(converted, tmp_path, capsys):
    target = tmp_path / "records" / "v.json"
    target.parent.mkdir()
    target.write_text(json.dumps({"format_version": 2, "verdict": "pass"}))  # a record verify may replace
    with attribute(target, "i"):
        _refused_first([str(converted), "--json-file", str(target)], capsys, tmp_path,
                       f"--json-file {target}: {target} is immutable (chattr +i), so v.json cannot be replaced there")


def test_json_file_in_an_append_only_folder_is_refused_first(converted, tmp_path, capsys):
    folder = tmp_path / "records"
    folder.mkdir()
    target = folder / "v.json"
    with attribute(folder, "a"):
        _refused_first([str(converted), "--json-file", str(target)], capsys, tmp_path,
                       f"--json-file {target}: {folder} is append-only (chattr +a), so v.json cannot be replaced "
                       "there")


def test_json_file_that_is_a_mount_point_is_refused_first(converted, tmp_path, capsys):
    folder = tmp_path / "records"
    folder.mkdir()
    target, other = folder / "v.json", folder / "elsewhere.json"
    for path in (target, other):
        path.write_text(json.dumps({"format_version": 2, "verdict": "pass"}))
    with bind_mounted(other, target):
        _refused_first([str(converted), "--json-file", str(target)], capsys, tmp_path,
                       f"--json-file {target}: {target} is a mount point of its own (a file mounted there), so "
                       "v.json cannot be replaced there")


def test_a_place_that_takes_the_file_still_gets_it(converted, tmp_path, capsys):
    target = tmp_path / "v.json"
    code, stdout, stderr = run(["verify", str(converted), "--quick", "--json-file", str(target), "-q"], capsys)
    assert code == 0 and stdout.startswith("PASS "), stderr
    record = json.loads(target.read_text())
    assert record["passed"] is True and record["verdict"] == stdout.strip()


def test_another_users_file_in_a_sticky_folder_cannot_be_replaced(tmp_path, monkeypatch):
    from qconvert.formats.errors import OutputWriteError
    from qconvert.write.replaceable import check_replaceable

    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o1777)  # /tmp's mode
    target = folder / "v.json"
    target.write_text("{}")
    check_replaceable(target, "--json-file")  # its owner may
    check_replaceable(folder / "new.json", "--json-file")  # a new name needs only the folder
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # another user, not root
    with pytest.raises(OutputWriteError) as refused:
        check_replaceable(target, f"--json-file {target}")
    assert str(refused.value) == (f"cannot write --json-file {target}: {target} belongs to another user in a sticky "
                                  f"folder ({folder}), so v.json cannot be replaced there; choose a place you can "
                                  "write to, before anything is computed")
    os.chmod(folder, 0o777)  # not sticky: anyone who may write the folder may rename over the file
    check_replaceable(target, "--json-file")
