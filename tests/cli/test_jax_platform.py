"""An XLA_FLAGS that XLA refuses is one line and exit 2 before anything is written (XLA itself would abort the
process from C++ once a run had begun, leaving its temporary folder behind)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import tree

QCONVERT = str(Path(sys.executable).parent / "qconvert")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("xla-flags") / "model")


@pytest.mark.parametrize("command", ["quantize", "calibrate"])
def test_an_unknown_xla_flag_is_one_line_exit_2_and_leaves_nothing(model, tmp_path, command):
    out = tmp_path / "target" / ("out" if command == "quantize" else "stats.safetensors")
    out.parent.mkdir()
    env = dict(os.environ, XLA_FLAGS="--xla_bogus_flag=1")
    done = subprocess.run([QCONVERT, command, str(model), "-o", str(out), "--calib", "random"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "XLA_FLAGS" in lines[0] and "--xla_bogus_flag" in lines[0], done.stderr
    assert list(out.parent.iterdir()) == []  # no OUT, no temporary beside it


def test_a_flag_xla_knows_passes_the_check(model, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([QCONVERT, "quantize", str(model), "-o", str(tmp_path / "out"), "-q"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "qconvert.json").is_file()


@pytest.mark.parametrize("variable, value", [("JAX_ENABLE_X64", "maybe"), ("JAX_NUM_CPU_DEVICES", "²")])
def test_a_jax_variable_jax_refuses_is_exit_2_naming_it(model, tmp_path, variable, value):
    before = tree(tmp_path)
    done = subprocess.run([QCONVERT, "quantize", str(model), "-o", str(tmp_path / "out"), "--json"],
                          env=dict(os.environ, **{variable: value}), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2
    assert done.stderr.startswith("qconvert: error: JAX cannot start with this environment") and \
        done.stderr.count("\n") == 1 and f"{variable}={value!r}" in done.stderr
    assert json.loads(done.stdout)["exit_code"] == 2
    assert tree(tmp_path) == before
