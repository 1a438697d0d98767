"""Faults of a run of several processes, each bounded in time by a short join deadline (QCONVERT_JOIN_TIMEOUT):
a process never started, a port taken, duplicate ids, something other than qconvert at the coordinator, a
process killed, SIGTERM and SIGINT. Each ends every process with one stderr line, a documented exit code and,
with --json, one JSON document (process 0's, or a process's own when it ended before the run was joined), and
leaves no OUT and no temporary beside it."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cluster_helpers import (JOIN_S, JOINED_S, entries, finish, free_port, launch, listening, the_document, the_error,
                             wait_for)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("source") / "llama"
    make_llama_checkpoint(folder, dtype="bfloat16", shards=2)
    return folder


def quantize(llama: Path, out: Path, *extra: str) -> list[str]:
    return ["quantize", str(llama), "-o", str(out), "--scheme", "int4", "--calib", "random", "--calib-samples", "8",
            "--calib-seqlen", "16", "--json", *extra]


def test_process_1_never_started(llama, tmp_path):
    started = time.monotonic()
    ((code, out, err),) = finish([launch(quantize(llama, tmp_path / "out"), free_port(), 2, 0)])
    assert code == 10
    line = the_error(err)
    assert line == f"process 1 of 2 did not join within {JOIN_S} s (not started, or given another coordinator than " \
                   f"127.0.0.1:{line.split('127.0.0.1:')[1].split(')')[0]})"
    the_document(out, 10, line)
    assert entries(tmp_path) == []
    assert time.monotonic() - started < JOIN_S + 30


def test_only_process_1_started(llama, tmp_path):
    port = free_port()
    ((code, out, err),) = finish([launch(quantize(llama, tmp_path / "out"), port, 2, 1)])
    assert code == 10, (out, err)
    line = the_error(err)
    assert line.startswith(f"cannot reach process 0 at 127.0.0.1:{port} within {JOIN_S} s (")
    assert line.endswith("); start process 0, with the same --coordinator")
    the_document(out, 10, line)  # no process 0 speaks for this run: process 1 says its own
    assert entries(tmp_path) == []


def test_a_coordinator_port_another_program_holds_is_refused_at_once(llama, tmp_path):
    with socket.create_server(("", 0)) as other:
        port = other.getsockname()[1]
        started = time.monotonic()
        ((code, out, err),) = finish([launch(quantize(llama, tmp_path / "out"), port, 2, 0)])
        waited = time.monotonic() - started
    assert code == 10
    line = the_error(err)  # no gRPC line, no segfault
    assert line == (f"the coordinator port {port} is taken on this host: another program (or another run) listens "
                    "there; give --coordinator a free port")
    the_document(out, 10, line)
    assert waited < JOIN_S  # at once, not after the join's deadline
    assert entries(tmp_path) == []


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\n\r\n", None])
def test_a_coordinator_where_another_program_listens(answer, llama, tmp_path):
    """Process 1 given the address of something that is not qconvert: it answers other bytes, or nothing."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        conn, _ = server.accept()
        held.append(conn)
        conn.recv(4096)
        if answer is not None:
            conn.sendall(answer)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    port = server.getsockname()[1]
    ((code, out, err),) = finish([launch(quantize(llama, tmp_path / "out"), port, 2, 1)])
    server.close()
    assert code == 10
    line = the_error(err)
    if answer is None:
        assert line == (f"127.0.0.1:{port} did not answer as qconvert's process 0 within {JOIN_S} s (another "
                        "program listens there?)")
    else:
        assert line == f"127.0.0.1:{port} is not qconvert's process 0 (it answered something else)"
    the_document(out, 10, line)
    assert entries(tmp_path) == []


def test_two_processes_started_with_one_id_refuse_the_run(llama, tmp_path):
    port = free_port()
    args = quantize(llama, tmp_path / "out")
    procs = [launch(args, port, 3, 0)]
    wait_for(lambda: listening(port), 60, "coordinator")
    procs += [launch(args, port, 3, 1), launch(args, port, 3, 1)]
    results = finish(procs)
    line = "two processes were started as process 1 of 3 (each needs its own --process-id, 0..2)"
    for code, out, err in results:
        assert code == 10
        assert the_error(err) == line
        the_document(out, 10, line)  # refused before the run was joined: every process says its own
    assert entries(tmp_path) == []


def test_a_second_run_given_the_same_coordinator_is_turned_away(llama, tmp_path):
    """Process 0 holds the coordinator's port for the whole run: a second run's process 0 cannot bind it, and a
    second run's process 1 is refused, never joined to the first run."""
    port = free_port()
    args = ["quantize", str(llama), "-o", str(tmp_path / "out"), "--json"]  # int8: no calibration, quick
    first = [launch(args, port, 2, 0, join_s=JOINED_S), launch(args, port, 2, 1, join_s=JOINED_S)]
    wait_for(lambda: listening(port), 60, "coordinator")
    second = [launch(quantize(llama, tmp_path / "other"), port, 2, i) for i in (0, 1)]
    (code0, out0, err0), (code1, out1, err1) = finish(second)
    assert (code0, the_error(err0)) == (10, f"the coordinator port {port} is taken on this host: another program "
                                            "(or another run) listens there; give --coordinator a free port")
    assert code1 == 10
    assert the_error(err1) == ("the run at this coordinator has already started (another run given the same "
                               "--coordinator?); give each run its own port")
    the_document(out1, 10, the_error(err1))
    results = finish(first)
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    assert [err for _, _, err in results] == ["", ""]  # no native line (gloo, gRPC, absl, XLA) on stderr
    assert json.loads(results[0][1])["exit_code"] == 0 and results[1][1] == ""
    assert entries(tmp_path) == ["out"]


def _mid_run(procs, tmp_path: Path) -> None:
    """Wait until process 0 has begun writing beside OUT (GPTQ's scratch folder: calibration is under way)."""
    wait_for(lambda: any(p.name != "out" for p in tmp_path.iterdir()) or any(p.poll() is not None for p in procs),
             120, "temporary folder beside OUT")
    assert all(p.poll() is None for p in procs), "a process ended before the run was under way"
    time.sleep(1)


@pytest.mark.parametrize("target,signum", [(0, signal.SIGTERM), (1, signal.SIGINT), (1, signal.SIGKILL)])
def test_a_signal_to_one_process_ends_the_run(target, signum, llama, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    port = free_port()
    args = quantize(llama, work / "out", "--calib-samples", "4000")
    procs = [launch(args, port, 2, i, join_s=JOINED_S) for i in (0, 1)]
    _mid_run(procs, work)
    procs[target].send_signal(signum)
    sent = time.monotonic()
    results = finish(procs, timeout=60)
    waited = time.monotonic() - sent
    expected = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: 10}[signum]
    message = {signal.SIGTERM: "interrupted by SIGTERM", signal.SIGINT: "interrupted",
               signal.SIGKILL: "process 1 of 2 stopped without a word (killed, out of memory, or its host gone)"}[signum]
    for index, (code, out, err) in enumerate(results):
        if index == target and signum == signal.SIGKILL:
            assert code == -signal.SIGKILL
            continue
        assert code == expected, err[-3000:]
        line = the_error(err)
        assert line == (message if index == target or signum == signal.SIGKILL
                        else f"process {target} failed: {message}")
        if index == 0:
            the_document(out, expected, line)
        else:
            assert out == ""  # process 0 speaks for the run
    assert waited < 20
    assert entries(work) == []  # no OUT, no staging or scratch folder


def test_sigint_while_process_0_waits_for_the_others(llama, tmp_path):
    port = free_port()
    proc = launch(quantize(llama, tmp_path / "out"), port, 2, 0)
    wait_for(lambda: listening(port), 60, "coordinator")
    proc.send_signal(signal.SIGINT)
    ((code, out, err),) = finish([proc], timeout=30)
    assert code == 130
    assert the_error(err) == "interrupted"
    the_document(out, 130, "interrupted")
    assert entries(tmp_path) == []


def test_a_jax_start_that_stalls_ends_on_qconverts_deadline_not_jaxs(llama, tmp_path):
    """Process 0 (played here) welcomes process 1 to a service port where nothing answers: jax.distributed would
    wait JAX's own deadline and abort from C++; qconvert's deadline ends the process first, one line, exit 10."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    with socket.socket() as probe:  # a port with nothing behind it
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    proc = launch(quantize(llama, tmp_path / "out"), port, 2, 1)
    conn, _ = server.accept()
    hello = json.loads(conn.makefile("rb").readline())
    assert (hello["kind"], hello["process"], hello["count"]) == ("qconvert-join", 1, 2)
    assert hello["settings"]["the command"] == "quantize" and hello["settings"]["--json"] is True
    conn.sendall(json.dumps({"kind": "welcome", "service_port": dead}).encode() + b"\n")
    started = time.monotonic()
    ((code, out, err),) = finish([proc], timeout=60)
    conn.close()
    server.close()
    assert code == 10
    assert the_error(err) == f"process 1 failed: jax.distributed did not start within {JOIN_S} s (process 0's " \
                             f"service at 127.0.0.1:{dead})"
    assert out == ""  # joined: process 0 speaks for the run
    assert time.monotonic() - started < JOIN_S + 30  # JAX's own deadline is 60 s later
    assert entries(tmp_path) == []
