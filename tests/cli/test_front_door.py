"""What a user meets first: bare `qconvert`, `--json` alike on every command, verify's output in a pipe,
progress on stderr, and a checkout the README's commands leave clean."""

import hashlib
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly, run
from rich.console import Console

from qconvert.cli.console import RichStages
from qconvert.progress import Lines

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("calibrate", "example-model", "inspect", "quantize", "verify")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("front") / "src")


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory):
    return quantize_quietly(source, tmp_path_factory.mktemp("front-out") / "int8")


def test_bare_qconvert_prints_a_short_usage_and_the_commands_with_exit_0(capsys):
    exit_code, stdout, stderr = run([], capsys)
    lines = stdout.splitlines()
    assert exit_code == 0 and stderr == ""
    assert lines[0] == "usage: qconvert [--version] [-h] COMMAND [ARGS]..."
    assert lines[2] == "commands:"
    assert [line.split()[0] for line in lines[3:3 + len(COMMANDS)]] == list(COMMANDS)
    assert lines[-1] == "`qconvert COMMAND -h` shows a command's flags and exit codes."
    assert "error" not in stdout and "Exit codes" not in stdout and len(lines) < 15


def test_verify_json_is_a_plain_flag_and_the_verdict_its_last_line_without_it(converted, capsys):
    code, stdout, stderr = run(["verify", str(converted), "--quick", "--json"], capsys)
    record = json.loads(stdout)
    assert code == 0 and record["passed"] is True
    # The table and verdict went to stderr, the verdict whole on its last line.
    assert stderr.rstrip("\n").splitlines()[-1] == record["verdict"]
    code, stdout, _ = run(["verify", str(converted), "--quick"], capsys)
    assert code == 0 and stdout.rstrip("\n").splitlines()[-1] == record["verdict"]
    assert re.fullmatch(r"PASS int8 \S+: 14 linears; worst linear \S+ at [\d.]+ dB; .*", record["verdict"])


def test_verify_table_names_are_whole_when_stdout_is_not_a_terminal(converted, capsys):
    code, stdout, _ = run(["verify", str(converted), "--quick"], capsys)
    names = [f"model.layers.{i}.{m}" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert code == 0 and all(re.search(rf"\s{re.escape(n)}\s", stdout) for n in names)
    assert "…" not in stdout


def test_verify_old_json_dash_spelling_still_prints_json(converted, capsys):
    code, stdout, _ = run(["verify", str(converted), "--quick", "--json", "-"], capsys)
    assert code == 0 and json.loads(stdout)["passed"] is True


def test_verify_json_file_writes_the_record_and_keeps_the_table_on_stdout(converted, tmp_path, capsys):
    path = tmp_path / "v.json"
    code, stdout, _ = run(["verify", str(converted), "--quick", "--json-file", str(path)], capsys)
    record = json.loads(path.read_text())
    assert code == 0 and stdout.rstrip("\n").splitlines()[-1] == record["verdict"]


def test_verify_json_file_in_a_missing_folder_is_refused_before_the_run(converted, tmp_path, capsys):
    path = tmp_path / "missing" / "v.json"
    code, stdout, stderr = run(["verify", str(converted), "--json-file", str(path)], capsys)
    assert code == 2 and stdout == ""
    assert stderr == (f"qconvert: error: --json-file {path}: the folder {path.parent} does not exist; "
                      "create it or choose another path\n")


def test_verify_quiet_prints_the_verdict_line_only(converted, capsys):
    code, stdout, stderr = run(["verify", str(converted), "--quick", "-q"], capsys)
    assert code == 0 and stderr == "" and len(stdout.splitlines()) == 1 and stdout.startswith("PASS int8 ")


def test_failed_verify_prints_its_json_and_a_one_line_verdict(converted, tmp_path, capsys):
    out = shutil.copytree(converted, tmp_path / "out")
    with open(out / "config.json", "a") as f:
        f.write(" ")
    code, stdout, stderr = run(["verify", str(out), "--quick", "--json"], capsys)
    record = json.loads(stdout)
    assert code == 1 and record["passed"] is False
    found = hashlib.sha256((out / "config.json").read_bytes()).hexdigest()
    assert record["verdict"].startswith(f"FAIL int8 {out}: integrity: config.json: ") and found[:12] in record["verdict"]
    assert stderr.rstrip("\n").splitlines()[-1] == record["verdict"]
    code, stdout, _ = run(["verify", str(out), "--quick"], capsys)
    assert code == 1 and stdout.rstrip("\n").splitlines()[-1] == record["verdict"]


def test_verify_on_bad_input_prints_a_json_error_record_and_one_line(tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    code, stdout, stderr = run(["verify", str(folder), "--json"], capsys)
    record = json.loads(stdout)
    # A folder without qconvert.json is an invalid folder (exit 6), as inspect and quantize say of one.
    assert code == 6 and len(stderr.splitlines()) == 1 and stderr.startswith("qconvert: error: ")
    message = stderr[len("qconvert: error: "):].rstrip("\n")
    from qconvert import __version__

    assert record == {"format_version": 2, "command": "verify", "qconvert_version": __version__, "exit_code": 6,
                      "error": message, "out": str(folder), "passed": False,
                      "verdict": f"ERROR {folder}: {message}"}


def test_verify_on_bad_input_writes_its_error_record_to_the_json_file(tmp_path, capsys):
    # A folder that is not there (refused before verify's readers start) and one that is no conversion (refused by
    # them): the same document on stdout and in --json-file, each with its own exit code.
    (tmp_path / "empty").mkdir()
    for folder, code in ((tmp_path / "missing", 3), (tmp_path / "empty", 6)):
        record_file = tmp_path / f"{folder.name}.json"
        got, stdout, _ = run(["verify", str(folder), "--json", "--json-file", str(record_file)], capsys)
        assert got == code
        assert json.loads(record_file.read_text()) == json.loads(stdout)
        assert json.loads(stdout)["exit_code"] == code and json.loads(stdout)["out"] == str(folder)


def test_quantize_calibrate_and_inspect_print_json_with_the_same_plain_flag(source, converted, tmp_path, capsys):
    code, stdout, stderr = run(["inspect", str(converted), "--json"], capsys)
    assert code == 0 and json.loads(stdout)["scheme"] == "int8"
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "o"), "--json"], capsys)
    assert code == 0 and json.loads(stdout)["scheme"] == "int8" and stderr == ""
    code, stdout, stderr = run(["calibrate", str(source), "-o", str(tmp_path / "s.safetensors"), "--calib", "random",
                                "--calib-samples", "2", "--calib-seqlen", "8", "--json"], capsys)
    assert code == 0 and json.loads(stdout)["linears"] == 2 * 7 + 1 and stderr == ""  # the block linears, lm_head


def test_w8a8_quantize_reports_each_calibration_stage_on_stderr_in_a_pipe(source, tmp_path, capsys):
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "w"), "--scheme", "w8a8",
                                "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "8",
                                "--scale-search", "--gptq"], capsys)
    assert code == 0 and stdout.startswith("wrote ")
    lines = stderr.splitlines()
    # The tiny Llama: 2 layers; 4 smoothing groups per layer (norm -> q/k/v, norm -> gate/up, v -> o, up -> down).
    for stage, count in (("calibrating", "2/2 layers"), ("alpha search", "8/8 groups"),
                         ("scale search", "14/14 linears"), ("GPTQ", "2/2 layers")):
        assert sum(re.fullmatch(rf"qconvert: {stage}: {count} in \d+\.\d s", line) is not None
                   for line in lines) == 1, stderr
    code, stdout, stderr = run(["quantize", str(source), "-o", str(tmp_path / "q"), "--scheme", "w8a8",
                                "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "8", "-q"], capsys)
    assert code == 0 and stdout == "" and stderr == ""


def test_verify_reports_its_stages_on_stderr_in_a_pipe(converted, capsys):
    code, _, stderr = run(["verify", str(converted), "--quick"], capsys)
    stages = [line.split(":")[1].strip() for line in stderr.splitlines()]
    assert code == 0 and stages == ["integrity", "per linear", "whole model"], stderr
    assert re.match(r"qconvert: per linear: 2/2 layers in \d+\.\d s$", stderr.splitlines()[1])


def test_plain_lines_show_a_stage_every_interval_and_when_it_ends():
    written, now = [], [0.0]
    lines = Lines(written.append, every=10.0, clock=lambda: now[0])
    lines.step("calibrating", 0, 4)
    for done, t in ((1, 3.0), (2, 11.0), (3, 12.0), (4, 30.5)):
        now[0] = t
        lines.step("calibrating", done, 4)
    lines("a line")
    assert written == ["calibrating: 2/4 layers", "calibrating: 4/4 layers in 30.5 s", "a line"]


def test_rich_stages_draw_a_bar_per_stage_with_count_and_eta():
    buffer = io.StringIO()
    stages = RichStages(Console(file=buffer, force_terminal=True, width=120, color_system=None))
    stages.step("calibrating", 0, 3)
    stages.step("GPTQ", 0, 3)  # a new stage is only another name
    for done in (1, 2, 3):
        stages.step("calibrating", done, 3)
        stages.step("GPTQ", done, 3)
    stages.stop()
    drawn = buffer.getvalue()
    for stage in ("calibrating", "GPTQ"):
        assert re.search(rf"{stage}\s+━+ 3/3 layers \d:\d\d:\d\d eta 0:00:00", drawn)


def readme_outputs() -> list[str]:
    """The files and folders the README's example commands write into the current folder."""
    names = []
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith("    ") and "qconvert " in line and "MODEL" not in line:
            names += re.findall(r"(?:-o|--out|--json-file)\s+([\w./-]+)", line)
    return names


def test_gitignore_covers_what_the_readme_commands_write():
    names = readme_outputs()
    assert {"minilm-int8", "verify.json"} <= set(names)
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("no git checkout")
    for name in names:
        # An output folder is ignored when a file inside it is.
        path = name if name.endswith((".json", ".safetensors")) else name.rstrip("/") + "/model.safetensors"
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"{name} is not in .gitignore"


def test_verify_table_on_a_narrow_terminal_folds_names_and_keeps_every_column(converted):
    from qconvert.verify.report import render
    from qconvert.verify.run import VerifyOptions, verify_folder

    report = verify_folder(converted, VerifyOptions(quick=True))
    buffer = io.StringIO()
    render(report, Console(file=buffer, width=72, color_system=None))
    lines = buffer.getvalue().splitlines()
    table = [line for line in lines if re.search(r"\d+\.\d\d\s+\d\.\d\de-\d\d", line)]
    assert len(table) == 14 and all(line.rstrip().endswith(" ok") for line in table)  # no column cropped
    assert max(len(line) for line in lines[:-1]) <= 72 and "…" not in buffer.getvalue()
    # Each name is folded over lines, never cut: its pieces are the first field of its row's lines.
    pieces = [line.split()[0] for line in lines if line.startswith(" ") and line.split()
              and re.fullmatch(r"[\w.]+", line.split()[0]) and not line.split()[0][0].isdigit()]
    joined = "".join(pieces)
    assert all(r.name in joined for r in report.layers)


def test_calibrate_reports_its_layers_on_stderr_and_q_silences_it(source, tmp_path, capsys):
    argv = ["calibrate", str(source), "--calib", "random", "--calib-samples", "2", "--calib-seqlen", "8"]
    code, stdout, stderr = run([*argv, "-o", str(tmp_path / "a.safetensors")], capsys)
    assert code == 0 and stdout.startswith(f"wrote {tmp_path / 'a.safetensors'}: 15 linears")
    assert re.search(r"^qconvert: calibrating: 2/2 layers in \d+\.\d s$", stderr, flags=re.MULTILINE), stderr
    code, stdout, stderr = run([*argv, "-o", str(tmp_path / "b.safetensors"), "-q"], capsys)
    assert code == 0 and stdout == "" and stderr == ""


ENVELOPE = ("format_version", "command", "qconvert_version", "exit_code", "error", "out")


def test_every_command_prints_the_same_json_envelope_on_success(source, converted, tmp_path, capsys):
    runs = {"quantize": ["quantize", str(source), "-o", str(tmp_path / "o"), "--json"],
            "calibrate": ["calibrate", str(source), "-o", str(tmp_path / "s.safetensors"), "--calib", "random",
                          "--calib-samples", "2", "--calib-seqlen", "8", "--json"],
            "inspect": ["inspect", str(converted), "--json"],
            "verify": ["verify", str(converted), "--quick", "--json"]}
    documents = {}
    for command, argv in runs.items():
        code, stdout, _ = run(argv, capsys)
        documents[command] = document = json.loads(stdout)
        assert code == 0 and tuple(document)[:len(ENVELOPE)] == ENVELOPE, (command, list(document))
        assert document["command"] == command and document["format_version"] == 2
        assert document["exit_code"] == 0 and document["error"] is None
    assert documents["quantize"]["out"] == str(tmp_path / "o") and documents["verify"]["out"] == str(converted)
    # The same thing under the same name: a source (quantize, calibrate) and a folder's stored bytes.
    assert documents["calibrate"]["source"] == documents["quantize"]["source"]
    inspected = json.loads(run(["inspect", str(tmp_path / "o"), "--json"], capsys)[1])
    assert inspected["output_bytes"] == documents["quantize"]["output_bytes"]


@pytest.mark.parametrize("argv, code", [
    (["{cmd}", "{missing}"], 3),            # a folder that is not there
    (["{cmd}", "{empty}"], 6),              # a folder without qconvert.json
    (["{cmd}", "{missing}", "--bogus"], 2),  # a flag no command has
])
def test_the_same_bad_input_is_the_same_exit_code_and_a_json_error_from_every_command(argv, code, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for command in ("inspect", "verify"):
        words = [w.format(cmd=command, missing=tmp_path / "missing", empty=tmp_path / "empty") for w in argv]
        got, stdout, stderr = run([*words, "--json"], capsys)
        document = json.loads(stdout)
        (line,) = stderr.strip().splitlines()
        assert got == code == document["exit_code"], (command, stderr)
        assert tuple(document)[:len(ENVELOPE)] == ENVELOPE and document["command"] == command
        assert line == f"qconvert: error: {document['error']}"
    for command in ("quantize", "calibrate"):  # MODEL, then OUT
        words = [w.format(cmd=command, missing=tmp_path / "missing", empty=tmp_path / "empty") for w in argv]
        got, stdout, stderr = run([*words, "-o", str(tmp_path / "out"), "--json"], capsys)
        document = json.loads(stdout)
        expected = 6 if code == 6 else code  # a model folder without config.json is invalid too
        assert got == expected == document["exit_code"], (command, stderr)
        assert document["command"] == command and not (tmp_path / "out").exists()
