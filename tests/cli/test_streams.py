"""A stdout its reader closed, before the command starts (`>&-`) or while it writes (`| head -1`): the output
goes nowhere, nothing is printed about it, and the command's own result decides the exit code."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import quantize_quietly

QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("closed-stdout")
    return quantize_quietly(make_llama_checkpoint(root / "model"), root / "int8")


def run_with_stdout_closed_at_start(args, env=None):
    # The child starts with no descriptor 1 at all, as `qconvert ... >&-` does in a shell.
    return subprocess.run([QCONVERT, *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          pass_fds=(), preexec_fn=lambda: os.close(1), env=env, timeout=600)


def run_with_reader_gone(args):
    # The reader closes the pipe before the child writes a byte: its first write meets EPIPE.
    child = subprocess.Popen([QCONVERT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    return child.wait(timeout=600), err


@pytest.mark.parametrize("args", [["inspect", "{out}"], ["inspect", "--json", "{out}"]], ids=["table", "json"])
def test_inspect_with_stdout_closed_at_start_exits_0_and_says_nothing(folder, args):
    done = run_with_stdout_closed_at_start([a.format(out=folder) for a in args])
    assert done.returncode == 0 and done.stderr.decode() == ""


def test_quantize_with_stdout_closed_at_start_writes_out_and_exits_0(tmp_path):
    model = make_llama_checkpoint(tmp_path / "model")
    done = run_with_stdout_closed_at_start(["quantize", str(model), "-o", str(tmp_path / "out")])
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "out" / "qconvert.json").is_file()
    assert "error" not in done.stderr.decode()


@pytest.mark.parametrize("args", [["inspect", "--json", "{out}"], ["verify", "--quick", "-q", "{out}"]],
                         ids=["inspect", "verify"])
def test_a_reader_that_left_does_not_change_the_exit_code(folder, args):
    code, err = run_with_reader_gone([a.format(out=folder) for a in args])
    assert code == 0, err
    assert "error" not in err and "Broken pipe" not in err and "Traceback" not in err
