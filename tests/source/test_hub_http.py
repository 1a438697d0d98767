"""A Hub endpoint that accepts connections and never answers: one line within about 10 s naming the endpoint and
what was slow (it held quantize for 402 s and 11 lines of huggingface_hub's retries)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hub_server import SilentHub


def _quantize_from(hub: SilentHub, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), JAX_PLATFORMS="cpu", HF_HUB_DISABLE_TELEMETRY="1")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", "from qconvert.cli.entry import main; main()", "quantize",
                           "some-org/some-model", "-o", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def test_a_silent_hub_is_one_line_within_seconds(tmp_path):
    with SilentHub() as hub:
        done, took = _quantize_from(hub, tmp_path)
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"127.0.0.1:{hub.port} accepted the connection but did not answer within 3 s" in line
    assert "HF_HUB_OFFLINE" not in line
    assert took < 20  # the probe's 3 s to connect and 3 s to hear an answer, and the process's start
    assert not (tmp_path / "out").exists()


def test_a_hub_that_answers_the_probe_then_falls_silent_is_one_line_within_the_read_bound(tmp_path):
    # Every request after the probe is bounded (qconvert.source.hub_http): one timeout ends the run, no
    # huggingface_hub retries (they held it for minutes, each wait longer than the last).
    with SilentHub(answer_probe=True) as hub:
        done, took = _quantize_from(hub, tmp_path)
    assert done.returncode == 4, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert f"127.0.0.1:{hub.port} accepted the request but sent nothing for 10 s" in line
    assert "HEAD /some-org/some-model/resolve/main/config.json" in line
    assert len([r for r in hub.requests if b"config.json" in r]) == 1  # asked once, not retried
    assert took < 30  # the 3 s probe, 10 s without an answer, the process's start
    assert not (tmp_path / "out").exists()
