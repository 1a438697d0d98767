"""The gate for values from outside: each kind checked by hand-worked cases, and `shown`'s one-line promise held
on generated text."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qconvert.formats import outside
from qconvert.formats.jsonfile import INVALID, JsonFileError, read_json_object
from qconvert.formats.outside import OutsideValueError


@pytest.mark.parametrize("text, expected", [
    ("plain name", "plain name"),
    ("a\nb", "a\\nb"),
    ("\x1b[31mred", "\\x1b[31mred"),
    ("tab\there", "tab\\there"),
    ("rtl\u202eevil", "rtl\\u202eevil"),
    ("line\u2028sep", "line\\u2028sep"),
    ("bytes\udcff\udcfe", "bytes\\xff\\xfe"),  # os.fsdecode's escapes of bytes that are not UTF-8
    ("café ½ 名前", "café ½ 名前"),  # printable letters and digits of any script stay
])
def test_shown_escapes_what_a_terminal_would_act_on(text, expected):
    assert outside.shown(text) == expected


def test_shown_bounds_a_long_text():
    shown = outside.shown("x" * 10_000)
    assert len(shown) == outside.SHOWN_MAX + 3 and "..." in shown


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=300))
def test_shown_is_one_printable_line(text):
    shown = outside.shown(text)
    assert "\n" not in shown and "\r" not in shown
    assert all(ch.isprintable() for ch in shown)
    shown.encode("utf-8")  # no lone surrogate left: a UTF-8 terminal, a log and JSON all take it


@pytest.mark.parametrize("written, expected", [("128", 128), (" 7 ", 7), ("+3", 3), ("-2", -2), (64, 64)])
def test_whole_numbers_in_ascii_digits(written, expected):
    assert outside.whole_number(written, "--n") == expected


@pytest.mark.parametrize("written", ["²", "١٢٨", "１２", "1.5", "", "12e3", "nan", "0x10", "1_000", "9" * 30, True])
def test_whole_numbers_refuse_other_digits_and_forms(written):
    with pytest.raises(OutsideValueError, match="--n"):
        outside.whole_number(written, "--n")


def test_whole_numbers_hold_their_bounds():
    assert outside.whole_number("5", "--n", low=1, high=5) == 5
    for written in ("0", "6"):
        with pytest.raises(OutsideValueError):
            outside.whole_number(written, "--n", low=1, high=5)


@pytest.mark.parametrize("written, expected", [("0.01", 0.01), (".5", 0.5), ("1e-3", 1e-3), ("-2", -2.0)])
def test_real_numbers(written, expected):
    assert outside.real_number(written, "--x") == expected


@pytest.mark.parametrize("written", ["nan", "inf", "-inf", "Infinity", "1e400", "０.５", "٠.٥", "", "1,5", math.nan])
def test_real_numbers_refuse_what_is_not_a_finite_ascii_number(written):
    with pytest.raises(OutsideValueError):
        outside.real_number(written, "--x")


@pytest.mark.parametrize("raw, why", [
    ("", "empty"), ("a\x00b", "NUL"), ("a/b\udcff", "not UTF-8"), ("a\nb", "control character"),
    ("x" * 256, "longer than 255"), ("a/" * 2100, "longer than 4096"),
])
def test_paths_refused(raw, why):
    with pytest.raises(OutsideValueError, match=why):
        outside.path(raw, "OUT")


def test_a_path_of_legal_names_is_taken():
    name = "é" * 127  # 254 bytes: within NAME_MAX
    assert str(outside.path(f"/tmp/{name}", "OUT")) == f"/tmp/{name}"


def test_folder_names_refuse_a_parent_that_is_not_utf8(tmp_path):
    with pytest.raises(OutsideValueError, match=r"\\xff"):
        outside.folder_names(tmp_path / "a\udcff" / "model", "MODEL")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_files_refuse_non_finite_numbers(tmp_path, constant):
    path = tmp_path / "config.json"
    path.write_text('{"initializer_range": %s}' % constant)
    with pytest.raises(JsonFileError) as err:
        read_json_object(path)
    assert err.value.kind == INVALID and constant in str(err.value)
    assert json.loads(path.read_text())  # Python's own json takes it: the refusal is qconvert's


def test_documents_and_json_files_write_null_for_figures_that_are_not_finite():
    from qconvert.formats.documents import dumps
    from qconvert.formats.jsonfile import json_bytes

    document = {"kl": math.nan, "ppl": [1.5, math.inf], "nested": {"x": -math.inf, "n": 3}}
    for text in (dumps(document), json_bytes(document).decode()):
        parsed = json.loads(text, parse_constant=outside.json_constant)  # a strict reader takes it
        assert parsed == {"kl": None, "ppl": [1.5, None], "nested": {"x": None, "n": 3}}
