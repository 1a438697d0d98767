"""The exit codes: docs/EXIT_CODES.md and every --help list the same; an unforeseen exception is one line, exit 70."""

import re
from pathlib import Path

import pytest

from cli_helpers import run, tree
from checkpoints import make_llama_checkpoint
from qconvert.cli.main import cli

README = Path(__file__).resolve().parents[2] / "docs" / "EXIT_CODES.md"  # the README links it


def readme_exit_codes() -> dict[int, str]:
    text = README.read_text(encoding="utf-8")
    table = text[text.index("table of exit codes:"):]
    table = table[:table.index("\n\n", table.index("| code |"))]
    return {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"^\| (\d+) \| (.+) \|$", table, re.M)}


def help_exit_codes(argv, capsys) -> dict[int, str]:
    exit_code, stdout, _ = run([*argv, "--help"], capsys)
    assert exit_code == 0
    section = stdout[stdout.index("Exit codes:"):]
    return {int(m.group(1)): m.group(2).strip() for m in re.finditer(r"^\s+(\d+)\s+(.+)$", section, re.M)}


@pytest.mark.parametrize("command", [[]] + [[name] for name in sorted(cli.commands)],
                         ids=["qconvert"] + sorted(cli.commands))
def test_readme_and_every_help_list_the_same_exit_codes(command, capsys):
    readme = readme_exit_codes()
    assert {0, 1, 2, 6, 70, 129, 130, 143} <= set(readme)
    assert set(help_exit_codes(command, capsys)) == set(readme)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("internal") / "src")


def test_an_unforeseen_exception_deep_in_quantize_is_one_line_and_exit_70(source, tmp_path, capsys, monkeypatch):
    import qconvert.write.tensors

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault\nsecond line of the message")

    monkeypatch.setattr(qconvert.write.tensors, "quantized_tensors", broken)  # runs on the prefetch thread
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 70 and stdout == ""
    assert stderr == ("qconvert: internal error in writing the output: RuntimeError: injected fault "
                      "(QCONVERT_DEBUG=1 shows the traceback)\n")
    assert tree(tmp_path) == before


def test_internal_errors_name_their_stage(source, tmp_path, capsys, monkeypatch):
    import qconvert.convert

    def broken(*args, **kwargs):
        raise KeyError("weight")

    monkeypatch.setattr(qconvert.convert, "plan_conversion", broken)
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 70
    assert stderr == ("qconvert: internal error in planning: KeyError: 'weight' "
                      "(QCONVERT_DEBUG=1 shows the traceback)\n")


def test_internal_error_in_calibration_of_w8a8(source, tmp_path, capsys, monkeypatch):
    import qconvert.methods.loop

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(qconvert.methods.loop, "tensor_folds", broken)  # every smoothed w8a8 run folds its scales
    before = tree(tmp_path)
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "w8a8",
                                "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16", "-q"], capsys)
    assert exit_code == 70
    assert stderr == ("qconvert: internal error in calibration: ZeroDivisionError: float division by zero "
                      "(QCONVERT_DEBUG=1 shows the traceback)\n")
    assert tree(tmp_path) == before


def test_internal_error_in_inspect_and_verify(source, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert run(["quantize", str(source), "-o", str(out), "-q"], capsys)[0] == 0
    import qconvert.inspection
    import qconvert.verify.run

    monkeypatch.setattr(qconvert.inspection, "_tensor_rows", lambda qc: [][1])
    exit_code, _, stderr = run(["inspect", str(out)], capsys)
    assert exit_code == 70 and stderr == ("qconvert: internal error in inspect: IndexError: list index out of range "
                                          "(QCONVERT_DEBUG=1 shows the traceback)\n")
    monkeypatch.setattr(qconvert.verify.run, "check_files", lambda folder, record: None + 1)
    before = tree(tmp_path)
    exit_code, _, stderr = run(["verify", str(out), "--quick"], capsys)
    assert exit_code == 70 and stderr.startswith("qconvert: internal error in verify: TypeError: ")
    assert stderr.endswith(" (QCONVERT_DEBUG=1 shows the traceback)\n") and stderr.count("\n") == 1
    assert tree(tmp_path) == before


def test_qconvert_debug_shows_the_traceback(source, tmp_path, capsys, monkeypatch):
    import qconvert.convert

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(qconvert.convert, "plan_conversion", broken)
    monkeypatch.setenv("QCONVERT_DEBUG", "1")
    exit_code, _, stderr = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    assert exit_code == 70 and "Traceback (most recent call last)" in stderr and "def broken" not in stderr
    assert "in broken" in stderr and stderr.splitlines()[-1].startswith("qconvert: internal error in planning")
