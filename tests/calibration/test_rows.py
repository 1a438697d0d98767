"""Records of calibration data files read with their size bounded: a line too long to be text to calibrate on is
refused after reading no more than the bound."""

from __future__ import annotations

import json

import pytest

from qconvert.calibration import rows
from qconvert.calibration.rows import DataFile, json_records
from qconvert.formats.errors import UsageError


def test_json_lines_are_read_a_record_at_a_time(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"row {k}"}) for k in range(3)) + "\n")
    got = list(json_records(DataFile(path, "data.jsonl", "calibration file data.jsonl")))
    assert got == [(f"line {k + 1}", {"text": f"row {k}"}) for k in range(3)]


def test_a_line_longer_than_the_bound_is_refused_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(rows, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 5000}) + "\n")
    records = json_records(DataFile(path, "data.jsonl", "calibration file data.jsonl"))
    assert next(records) == ("line 1", {"text": "short"})
    with pytest.raises(UsageError, match="calibration file data.jsonl line 2 is longer than"):
        next(records)
