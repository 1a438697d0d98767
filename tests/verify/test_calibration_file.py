"""A --calib FILE is recorded as the source model is: by its name and sha256, and where it lies from OUT when it
lies in OUT's parent folder; never by a path of this machine. verify finds it from any working folder where it
can (and checks its evaluation text against it), or says in one line why it cannot."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer
from cli_helpers import run

from qconvert.calibration.documents import builtin_corpus_text
from qconvert.formats.act_stats import load_act_stats

TINY = {"hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64, "vocab": 256}
CALIB = ["--calib-samples", "4", "--calib-seqlen", "32"]
VERIFY = ["--quick", "--backend", "xla", "--json"]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """tmp/work holds the model and the outputs (the working folder); tmp/elsewhere is another folder."""
    work = tmp_path / "work"
    make_tokenizer(make_llama_checkpoint(work / "llama", **TINY), vocab_size=256)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(work)
    return work


def text_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(builtin_corpus_text()[:6000], encoding="utf-8")
    return path


def strings(value, path="qconvert.json"):
    """Every string of a JSON value, keys included, with where it is."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{path}.{key}", key
            yield from strings(item, f"{path}.{key}")
    elif isinstance(value, list):
        for k, item in enumerate(value):
            yield from strings(item, f"{path}[{k}]")


def published(out: Path, machine: Path) -> dict:
    """qconvert.json, checked to hold no absolute path and nothing of the machine's folders, the card too."""
    record = json.loads((out / "qconvert.json").read_text())
    for where, text in strings(record):
        assert not os.path.isabs(text) and str(machine) not in text and str(Path.home()) not in text, where
    assert str(machine) not in (out / "README.md").read_text()
    return record


def quantize(out: Path, calib: str, capsys, *extra: str) -> None:
    code, _, err = run(["quantize", "llama", "-o", str(out), "--scheme", "w8a8", "-q", "--calib", calib, *CALIB,
                        *extra], capsys)
    assert code == 0, err


def verify(out: Path, capsys, *extra: str) -> dict:
    code, report, err = run(["verify", str(out), *VERIFY, *extra], capsys)
    assert code == 0, err
    return json.loads(report)["evaluation"]["held_out"]


def test_a_file_beside_out_is_found_from_any_working_folder(work, tmp_path, capsys, monkeypatch):
    sha = hashlib.sha256(text_file(work / "texts" / "calib.txt").read_bytes()).hexdigest()
    quantize(work / "out", "texts/calib.txt", capsys)
    quantize(work / "texts" / "out", str(work / "texts" / "calib.txt"), capsys)  # typed absolute: the same
    calibration = published(work / "out", tmp_path)["calibration"]
    assert calibration["source"] == "calib.txt" and calibration["sha256"] == sha
    assert calibration["file_from_out"] == "../texts/calib.txt"
    assert calibration["description"] == "local file calib.txt"
    assert published(work / "texts" / "out", tmp_path)["calibration"] == {**calibration, "file_from_out": "../calib.txt"}

    monkeypatch.chdir(tmp_path / "elsewhere")
    for out in (work / "out", Path(os.path.relpath(work / "texts" / "out"))):
        held_out = verify(out, capsys)
        assert held_out["disjoint"] is True, held_out["note"]
        assert held_out["note"].startswith("held out from calibration (local file calib.txt)")
    # Found and read: the file evaluated on is the calibration file, refused (its 16-token runs are shared).
    code, _, err = run(["verify", str(work / "out"), *VERIFY, "--calib", str(work / "texts" / "calib.txt")], capsys)
    assert code == 2 and "calibration file calib.txt (the same sha256)" in err.strip().splitlines()[-1]

    # The file moved: one line, why and what to do; the folder still verifies.
    (work / "texts" / "calib.txt").rename(tmp_path / "elsewhere" / "calib.txt")
    monkeypatch.chdir(tmp_path)
    held_out = verify(work / "out", capsys)
    assert held_out["disjoint"] is None
    assert held_out["note"] == (
        "calibration text 'calib.txt' cannot be rebuilt (the calibration file calib.txt is neither at "
        "../texts/calib.txt from OUT nor in the working folder: put it back, or run verify from the folder that "
        "holds it): disjointness not checked")
    monkeypatch.chdir(tmp_path / "elsewhere")  # where it now lies
    assert verify(work / "out", capsys)["disjoint"] is True


@pytest.mark.parametrize("where", ["outside/calib.txt",
                                   "work/texts/calib.txt",  # beside the model, not in OUT's parent (work/deep)
                                   # a file of a local Hub cache's snapshot
                                   "hub/datasets--someone--corpus/snapshots/0123abcd/train.txt"])
def test_a_file_outside_outs_parent_is_recorded_by_name_and_sha256(work, tmp_path, capsys, monkeypatch, where):
    calib = text_file(tmp_path / where)
    out = work / "deep" / "out"
    quantize(out, os.path.relpath(calib), capsys)
    calibration = published(out, tmp_path)["calibration"]
    assert calibration["source"] == calib.name and "file_from_out" not in calibration
    assert calibration["description"] == f"local file {calib.name}"

    monkeypatch.chdir(tmp_path / "elsewhere")
    held_out = verify(out, capsys)
    assert held_out["disjoint"] is None
    assert held_out["note"] == (
        f"calibration text '{calib.name}' cannot be rebuilt (qconvert.json records the calibration file "
        f"{calib.name} by its name and sha256 only (it lay outside OUT's parent folder) and the working folder has "
        f"no {calib.name}: run verify from the folder that holds it): disjointness not checked")
    monkeypatch.chdir(calib.parent)
    assert verify(out, capsys)["disjoint"] is True
    calib.write_text(builtin_corpus_text()[6000:12000], encoding="utf-8")  # another text of the same name
    held_out = verify(out, capsys)
    assert held_out["disjoint"] is None and "is not the one the conversion read (its sha256 differs)" in \
        held_out["note"]


def test_statistics_from_calibrate_keep_the_file_beside_them(work, tmp_path, capsys, monkeypatch):
    """A statistics file records the file from itself as qconvert.json does from OUT; quantize --act-stats
    records it from its own OUT."""
    text_file(work / "texts" / "calib.txt")
    code, _, err = run(["calibrate", "llama", "-o", "s.safetensors", "--calib", "texts/calib.txt", *CALIB,
                        "-q"], capsys)
    assert code == 0, err
    kept = load_act_stats(work / "s.safetensors").calibration
    assert kept["source"] == "calib.txt" and kept["file_from_out"] == "../texts/calib.txt"
    assert not [text for _, text in strings(kept) if str(tmp_path) in text]
    monkeypatch.chdir(tmp_path)  # --act-stats from another folder: the file found from the statistics file
    code, _, err = run(["quantize", str(work / "llama"), "-o", str(work / "out"), "--scheme", "w8a8",
                        "-q", "--act-stats", str(work / "s.safetensors")], capsys)
    assert code == 0, err
    calibration = published(work / "out", tmp_path)["calibration"]
    assert calibration["source"] == "calib.txt" and calibration["file_from_out"] == "../texts/calib.txt"
    assert calibration["stats_file"]["name"] == "s.safetensors"
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert verify(work / "out", capsys)["disjoint"] is True
