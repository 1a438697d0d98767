"""vLLM 0.33's own loading code judges int8, int4 and w8a8 folders of a dense and a MoE family.

It runs only where its virtual environment was built (bash ../shared/vllm/setup_venv.sh .vllm-venv,
about 4 minutes, 2.4 GB); CI does not build it. bench/vllm_check.py runs the same check over any models.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import make_hf_checkpoint

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
CHECK = ROOT.parent / "shared" / "vllm" / "vllm_accept.py"

pytestmark = pytest.mark.skipif(not (VENV_PYTHON.exists() and CHECK.exists()),
                                reason="vLLM's check needs .vllm-venv (../shared/vllm/setup_venv.sh)")
SCHEMES = {"int8": [], "int4": [], "w8a8": ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_vllm_loads_the_folder_and_reads_it_as_compressed_tensors_does(family, scheme, tmp_path, capsys):
    # bf16, as served: a float32 checkpoint is cast to bf16 on load, which the check reports as lossy.
    # (Qwen3-MoE has no dense MLP, so its intermediate_size may not exceed what its weights hold.)
    source = make_hf_checkpoint(tmp_path / "src", family, hidden=128, intermediate=128 if "moe" in family else 256,
                                layers=1, dtype="bfloat16")
    out = tmp_path / scheme
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *SCHEMES[scheme]],
                           capsys)
    assert code == 0, err
    done = subprocess.run([str(VENV_PYTHON), CHECK.name, str(out), "--ref", str(source)], cwd=CHECK.parent,
                          capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    verdict = [line for line in done.stdout.splitlines() if line.startswith("VERDICT")]
    assert verdict and verdict[-1].split()[1] == "OK", done.stdout[-3000:]
