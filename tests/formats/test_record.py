"""qconvert.json's one owner (formats.record) and the one JSON-object reader (formats.jsonfile)."""

import base64
import hashlib
import json
import os

import numpy as np
import pytest

from qconvert.formats import jsonfile, record
from qconvert.formats.jsonfile import JsonFileError, json_bytes, read_json_object, write_json
from qconvert.formats.record import RECORD_NAME, RecordError, check_hashes, read_record, write_record


@pytest.mark.parametrize("content, kind", [
    (None, jsonfile.MISSING),
    (b"{", jsonfile.INVALID),
    (b"\xff\xfe{}", jsonfile.INVALID),
    (b"[1, 2]", jsonfile.NOT_OBJECT),
    (b"\"text\"", jsonfile.NOT_OBJECT),
])
def test_the_reader_says_why_a_file_holds_no_json_object(tmp_path, content, kind):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(JsonFileError) as info:
        read_json_object(path)
    assert info.value.kind == kind and info.value.path == path and str(path) in str(info.value)


def test_the_reader_calls_a_folder_unreadable_and_keeps_the_os_error(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(JsonFileError) as info:
        read_json_object(tmp_path / "config.json")
    assert info.value.kind == jsonfile.UNREADABLE and isinstance(info.value.cause, OSError)


def test_the_reader_returns_the_object(tmp_path):
    (tmp_path / "a.json").write_text('{"b": [1, "\\u00e9"], "a": null}', encoding="utf-8")
    assert read_json_object(tmp_path / "a.json") == {"b": [1, "é"], "a": None}


def test_the_writer_writes_the_documented_bytes_and_returns_their_sha256(tmp_path):
    expected = b'{\n  "b": [\n    1,\n    "\xc3\xa9"\n  ],\n  "a": null\n}\n'  # 2-space indent, UTF-8, newline
    assert json_bytes({"b": [1, "é"], "a": None}) == expected
    digest = write_json(tmp_path / "x.json", {"b": [1, "é"], "a": None})
    assert (tmp_path / "x.json").read_bytes() == expected
    assert digest == hashlib.sha256(expected).hexdigest()
    assert os.stat(tmp_path / "x.json").st_mode & 0o777 == 0o644


def test_a_written_record_reads_back_with_its_source_and_files(tmp_path):
    written = record.ConversionRecord("nf4", {"config.json": "0" * 64},
                                      record.SourceRecord("org/m", True, "main", "abc"))
    digest = write_record(tmp_path, written)
    assert RECORD_NAME == "qconvert.json"
    assert digest == hashlib.sha256((tmp_path / "qconvert.json").read_bytes()).hexdigest()
    got = read_record(tmp_path)
    assert got == written
    assert (got.scheme, got.files, got.source_model, got.source_revision) == (
        "nf4", {"config.json": "0" * 64}, "org/m", "abc")


@pytest.mark.parametrize("content, kind", [
    (None, record.NO_RECORD),
    ("{", record.UNREADABLE),
    ("[]", record.NO_FILES),
    ('{"scheme": "int8"}', record.NO_FILES),
    ('{"scheme": "int8", "files": {"a": 1}}', record.NO_FILES),
])
def test_a_record_that_cannot_be_used_says_how(tmp_path, content, kind):
    if content is not None:
        (tmp_path / "qconvert.json").write_text(content)
    with pytest.raises(RecordError) as info:
        read_record(tmp_path)
    assert info.value.kind == kind and info.value.path == tmp_path / "qconvert.json"


def test_a_record_without_a_scheme_reads_with_scheme_none(tmp_path):
    (tmp_path / "qconvert.json").write_text(json.dumps({"files": {}, "scheme": 3}))
    assert read_record(tmp_path).scheme is None


def test_hashes_are_checked_against_hashlib_and_paths_outside_the_folder_are_never_read(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"abc")
    (folder / "b.bin").write_bytes(b"changed")
    (tmp_path / "secret").write_bytes(b"abc")
    good = hashlib.sha256(b"abc").hexdigest()
    write_record(folder, record.ConversionRecord("int8", {
        "b.bin": good, "a.bin": good, "gone.bin": good, "../secret": good}))
    checks = check_hashes(folder, read_record(folder))
    assert [(c.name, c.actual, c.outside, c.ok) for c in checks] == [
        ("../secret", None, True, False),
        ("a.bin", good, False, True),
        ("b.bin", hashlib.sha256(b"changed").hexdigest(), False, False),
        ("gone.bin", None, False, False),
    ]


def test_smoothing_scales_are_written_exactly_and_a_format_1_record_reads_without_them(tmp_path):
    rng = np.random.default_rng(0)
    # float32 values no decimal shortcut would keep: random mantissas over six octaves.
    source = (rng.random(96) * 2.0 ** rng.integers(-3, 3, 96)).astype(np.float32)
    wide = np.repeat(source, 2)
    smoothing = record.SmoothingRecord("auto", 0.85, 1e-5, "remedy", {"n": 0.4, "v": 0.6},
                                       {"n": ("q", "k"), "v": ("o",)}, {
                                           "n": record.RecordedScales(source, source.copy()),
                                           "v": record.RecordedScales(source, wide, 0, 0.0)})
    write_record(tmp_path, record.ConversionRecord("w8a8", {}, smoothing=smoothing))
    raw = json.loads((tmp_path / "qconvert.json").read_text())
    assert raw["format_version"] == 2 and raw["smoothing"]["encoding"] == "float32-le-base64"
    assert "input_scales" not in raw["smoothing"]["scales"]["n"]  # the same as the source's: written once
    assert np.frombuffer(base64.b64decode(raw["smoothing"]["scales"]["v"]["input_scales"]), "<f4").tolist() == \
        wide.tolist()
    got = read_record(tmp_path).smoothing
    for name, want in (("n", source), ("v", wide)):
        assert got.scales[name].input_scales.dtype == np.float32
        np.testing.assert_array_equal(got.scales[name].input_scales, want)
        np.testing.assert_array_equal(got.scales[name].source_scales, source)
    # A record written before the scales were: the groups read, none of them scaled, and it writes back the same.
    del raw["smoothing"]["scales"], raw["smoothing"]["encoding"], raw["format_version"]
    (tmp_path / "qconvert.json").write_text(json.dumps(raw))
    old = read_record(tmp_path)
    assert old.format_version == 1 and old.smoothing.unscaled == ["n", "v"]
    assert {k: v for k, v in old.to_json().items() if k != "format_version"} == raw
