"""A Hub endpoint that accepts connections and never answers: one line within about 10 s naming the endpoint and
what was slow (it held quantize for 402 s and 11 lines of huggingface_hub's retries)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time


def test_a_silent_hub_is_one_line_within_seconds(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"), JAX_PLATFORMS="cpu")
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", "from qconvert.cli.entry import main; main()", "quantize",
                               "some-org/some-model", "-o", str(tmp_path / "out")],
                              env=env, capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        for conn in held:
            conn.close()
        server.close()
    took = time.monotonic() - started
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"127.0.0.1:{port} accepted the connection but did not answer within 3 s" in line
    assert "HF_HUB_OFFLINE" not in line
    assert took < 20  # the probe's 3 s to connect and 3 s to hear an answer, and the process's start
    assert not (tmp_path / "out").exists()


def test_a_hub_that_answers_the_probe_then_falls_silent_is_one_line_within_the_read_bound(tmp_path):
    # Every request after the probe is bounded (qconvert.source.hub_http): one timeout ends the run, no
    # huggingface_hub retries (they held it for minutes, each wait longer than the last).
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    held: list[socket.socket] = []
    requests: list[bytes] = []
    stop = threading.Event()

    def answer_the_probe_only():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except OSError:
                continue
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                    data += chunk
            except OSError:
                pass
            requests.append(data.split(b"\r\n")[0])
            if data.startswith(b"HEAD / "):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                conn.close()
            else:
                held.append(conn)

    threading.Thread(target=answer_the_probe_only, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"), JAX_PLATFORMS="cpu",
               HF_HUB_DISABLE_TELEMETRY="1")
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", "from qconvert.cli.entry import main; main()", "quantize",
                               "some-org/some-model", "-o", str(tmp_path / "out")],
                              env=env, capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        for conn in held:
            conn.close()
        server.close()
    took = time.monotonic() - started
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"127.0.0.1:{port} accepted the request but sent nothing for 10 s" in line
    assert "HEAD /some-org/some-model/resolve/main/config.json" in line
    config_requests = [r for r in requests if b"config.json" in r]
    assert len(config_requests) == 1  # asked once, not retried
    assert took < 30  # the 3 s probe, 10 s without an answer, the process's start
    assert not (tmp_path / "out").exists()
