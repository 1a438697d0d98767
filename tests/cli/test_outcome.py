"""The one exit path: whatever ends a command, one stderr line on failure and exactly one --json document."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from qconvert.cli import outcome


@pytest.fixture(autouse=True)
def fresh():
    outcome.start("quantize")
    yield
    outcome.start(None)


def test_a_held_result_is_printed_once_when_the_run_ends_as_it_says(capsys):
    outcome.hold_document("quantize", {"out": "o", "linears": 3})
    outcome.finish(0)
    outcome.finish(0)
    out, err = capsys.readouterr()
    assert json.loads(out) == {**json.loads(out), "exit_code": 0, "error": None, "linears": 3} and err == ""


def test_a_failure_after_the_result_replaces_its_document(capsys):
    """A result held with exit 0, then a peer's failure decides the run: only the failure's document prints."""
    outcome.note_out("o")
    outcome.hold_document("quantize", {"out": "o"})
    assert outcome.say_failure("process 1 failed: out of memory", 10)
    outcome.finish(10)
    out, err = capsys.readouterr()
    document = json.loads(out)  # one document: json.loads refuses two
    assert (document["exit_code"], document["error"]) == (10, "process 1 failed: out of memory")
    assert err == "qconvert: error: process 1 failed: out of memory\n"


def test_a_result_that_ends_in_its_refusal_is_the_one_document(capsys):
    outcome.hold_document("quantize", {"out": "o", "uploaded": False}, 4, "the Hub did not answer")
    outcome.say_failure("the Hub did not answer", 4)
    out, err = capsys.readouterr()
    document = json.loads(out)
    assert document["uploaded"] is False and document["exit_code"] == 4
    assert err == "qconvert: error: the Hub did not answer\n"


def test_the_first_failure_is_the_one_said(capsys):
    assert outcome.say_failure("first", 2)
    assert not outcome.say_failure("second", 70)
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == "first" and err == "qconvert: error: first\n"


def test_a_failure_line_is_escaped_in_the_line_and_the_document(capsys):
    outcome.say_failure("bad name model.\x1b[2Jx\nweight", 6)
    out, err = capsys.readouterr()
    assert err == "qconvert: error: bad name model.\\x1b[2Jx\\nweight\n"
    assert json.loads(out)["error"] == "bad name model.\\x1b[2Jx\\nweight"


def test_a_process_that_does_not_speak_for_the_run_prints_its_line_only(capsys):
    outcome.say_failure("process 1: bad input", 6, leader=False)
    out, err = capsys.readouterr()
    assert out == "" and err == "qconvert: error: process 1: bad input\n"


def test_a_thread_says_the_failure_too(capfd):
    """A thread ending the process (the signal watchdog, the watch) writes the line itself, once."""
    said = []
    worker = threading.Thread(target=lambda: said.append(outcome.say_failure("interrupted by SIGTERM", 143)))
    worker.start()
    worker.join()
    sys.stdout.flush()
    out, err = capfd.readouterr()
    assert said == [True] and json.loads(out)["exit_code"] == 143
    assert err == "qconvert: error: interrupted by SIGTERM\n"


SLEEPER = """
import sys, time
from qconvert.cli import main as cli_main
from qconvert.cli import inspect as cli_inspect
from qconvert import interrupts

def stuck(*args, **kwargs):  # the main thread held where no Python handler runs in time
    print("ready", file=sys.stderr, flush=True)
    while True:
        with interrupts.deferred():
            time.sleep(60)

cli_inspect.require_converted_folder = stuck
interrupts.install()
cli_main.main(["inspect", sys.argv[1], "--json"])
"""


def test_a_signal_while_the_main_thread_is_held_still_prints_the_document(tmp_path):
    """SIGTERM while the main thread cannot leave: the watchdog ends the run through the same exit path, so
    --json still gets its one document and stderr its one line."""
    child = subprocess.Popen([sys.executable, "-c", SLEEPER, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stderr.readline() == "ready\n"
    started = time.monotonic()
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 143 and time.monotonic() - started < 30
    document = json.loads(out)
    assert (document["exit_code"], document["error"], document["command"]) == (143, "interrupted by SIGTERM",
                                                                                 "inspect")
    assert err == "qconvert: error: interrupted by SIGTERM\n"
    assert os.listdir(tmp_path) == []
