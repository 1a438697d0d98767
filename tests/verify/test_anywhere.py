"""A local source is recorded so that verify finds it from any working folder, and no local path is published:
convert in one folder, verify from another (the CI layout); a source that is gone is one line naming --reference,
never a trip to the Hub."""

from __future__ import annotations

import json

from checkpoints import make_llama_checkpoint
from cli_helpers import run


def test_convert_here_verify_there(tmp_path, capsys, monkeypatch):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_llama_checkpoint(work / "llama-tiny")
    monkeypatch.chdir(work)
    assert run(["quantize", "llama-tiny", "-o", "llama-int8", "-q"], capsys)[0] == 0
    record = json.loads((work / "llama-int8" / "qconvert.json").read_text())
    assert record["source"]["model"] == "llama-tiny" and record["source"]["is_hub"] is False
    assert record["source"]["folder_from_out"] == "../llama-tiny"
    for name in ("qconvert.json", "README.md", "config.json"):
        assert str(tmp_path) not in (work / "llama-int8" / name).read_text()  # no local path published

    monkeypatch.chdir(elsewhere)
    code, out, err = run(["verify", str(work / "llama-int8"), "--quick", "--backend", "xla", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["reference"]["from"] == "qconvert.json"

    (work / "llama-tiny").rename(tmp_path / "moved")
    code, out, err = run(["verify", str(work / "llama-int8"), "--quick", "--backend", "xla"], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()[-1:]
    assert line == (f"qconvert: error: the source folder qconvert.json records (../llama-tiny from "
                    f"{work / 'llama-int8'}) is not there; pass --reference with the float model the folder was "
                    "converted from")
    assert "Hub" not in err
    code, _, err = run(["verify", str(work / "llama-int8"), "--quick", "--backend", "xla", "--reference",
                        str(tmp_path / "moved")], capsys)
    assert code == 0, err
