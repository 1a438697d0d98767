"""vLLM 0.33's and vLLM TPU 0.32's own loading code judge int8, int4, w8a8 and fp8 folders of a dense family and
two MoE ones (DeepSeek-V3's with latent attention), and the servers table (qconvert/schemes/servers.py, what
`qconvert inspect` prints) says what they say.

They run only where their virtual environments were built (bash ../shared/vllm/setup_venv.sh .vllm-venv, about
4 minutes, 2.4 GB; bash ../shared/vllm-tpu/setup_venv.sh .vllm-tpu-venv, about 5 minutes, 9 GB) beside the checks
in ../shared, and are skipped, naming what is missing, elsewhere; CI does not build them. `pytest -m vllm` runs
them alone. bench/vllm_check.py runs the same checks over any models.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cli_helpers import run as run_cli
from hf_checkpoints import make_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
CHECK = ROOT.parent / "shared" / "vllm" / "vllm_accept.py"
TPU_PYTHON = ROOT / ".vllm-tpu-venv" / "bin" / "python"
TPU_CHECK = ROOT.parent / "shared" / "vllm-tpu" / "tpu_accept.py"


def _needs(what: str, setup: str, *paths: Path):
    """Skip unless every path exists; the reason names the missing ones and the command that builds the venv."""
    missing = [os.path.relpath(p, ROOT) for p in paths if not p.exists()]
    return pytest.mark.skipif(bool(missing), reason=f"{what} needs {' and '.join(missing)} (bash {setup})")


pytestmark = pytest.mark.vllm
needs_vllm = _needs("vLLM's check", "../shared/vllm/setup_venv.sh .vllm-venv", VENV_PYTHON, CHECK)
needs_vllm_tpu = _needs("vLLM TPU's check", "../shared/vllm-tpu/setup_venv.sh .vllm-tpu-venv", TPU_PYTHON, TPU_CHECK)

CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]
# Each scheme's folder as round-to-nearest writes it, so --ref can hold every code within half a step of the float
# weight; "int4-gptq" is int4's default (GPTQ, whose error feedback moves codes further), judged without --ref.
SCHEMES = {"int8": [], "int4": ["--no-gptq", "--no-awq"], "int4-gptq": CALIB, "fp8": [], "w8a8": CALIB}
# bf16, as served: a float32 checkpoint is cast to bf16 on load, which the check reports as lossy. Qwen3-MoE has no
# dense MLP, so its intermediate_size may not exceed what its weights hold; DeepSeek-V3's second layer is its
# first with experts, its widths (hidden a multiple of 128, latents of 128) ones vLLM's MoE kernels and int4's
# groups of 128 take, as the released models'.
SOURCES = {"llama": dict(hidden=128, intermediate=256, layers=1),
           "qwen3_moe": dict(hidden=128, intermediate=128, layers=1, moe_intermediate_size=128),
           "deepseek_v3": dict(hidden=128, intermediate=256, layers=2, kv_heads=4, q_lora_rank=128, kv_lora_rank=128,
                               qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, moe_intermediate_size=128)}


def bf16_source(folder, family):
    return make_hf_checkpoint(folder, family, dtype="bfloat16", **SOURCES[family])


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SOURCES))
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_vllm_loads_the_folder_and_reads_it_as_compressed_tensors_does(family, scheme, tmp_path, capsys):
    source = bf16_source(tmp_path / "src", family)
    out = tmp_path / scheme
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme.split("-")[0], "-q",
                            *SCHEMES[scheme]], capsys)
    assert code == 0, err
    ref = [] if scheme.endswith("-gptq") else ["--ref", str(source)]
    done = subprocess.run([str(VENV_PYTHON), CHECK.name, str(out), *ref], cwd=CHECK.parent,
                          capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert verdict_of(done.stdout) == "OK", done.stdout[-3000:]


def verdict_of(report: str) -> str:
    """OK, REFUSE or WRONG: the check's last VERDICT line."""
    verdicts = [line.split()[1] for line in report.splitlines() if line.startswith("VERDICT")]
    return verdicts[-1] if verdicts else "no verdict"


@pytest.mark.slow
@needs_vllm_tpu
@pytest.mark.parametrize("family, scheme", [("llama", "fp8"), ("qwen3_moe", "fp8"), ("llama", "int8"),
                                            ("llama", "w8a8"), ("qwen3_moe", "int4"), ("deepseek_v3", "fp8"),
                                            ("deepseek_v3", "int8")])
def test_vllm_tpu_says_what_the_servers_table_records(family, scheme, tmp_path, capsys):
    from qconvert.schemes.servers import NO, YES, servers

    source = bf16_source(tmp_path / "src", family)
    out = tmp_path / scheme
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *SCHEMES[scheme]],
                           capsys)
    assert code == 0, err
    recorded = servers(scheme, family)
    for impl, server in (("auto", "vLLM TPU"), ("vllm", "vLLM TPU MODEL_IMPL_TYPE=vllm")):
        done = subprocess.run([str(TPU_PYTHON), TPU_CHECK.name, str(out), "--impl", impl], cwd=TPU_CHECK.parent,
                              capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert recorded[server] in (YES, NO)
        assert verdict_of(done.stdout) == ("OK" if recorded[server] == YES else "REFUSE"), done.stdout[-3000:]


# W4A8-FP8 needs what vLLM's kernels take: group 128, input widths multiples of 128 (experts': 256).
W4A8_SOURCES = {"llama": dict(hidden=256, intermediate=512, layers=1),
                "qwen3_moe": dict(hidden=256, intermediate=256, layers=1, moe_intermediate_size=256, head_dim=64)}


def w4a8_folder(family, tmp_path, capsys):
    source = make_hf_checkpoint(tmp_path / "src", family, dtype="bfloat16", **W4A8_SOURCES[family])
    out = tmp_path / "w4a8"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "w4a8-fp8", "--no-gptq", "--no-awq", "-q"],
                           capsys)
    assert code == 0, err
    return source, out


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(W4A8_SOURCES))
def test_vllm_loads_w4a8_fp8_as_an_h100_would(family, tmp_path, capsys):
    # vLLM 0.33 matches W4A8-FP8 on compute capability 9.0 only: vllm_accept.py alone refuses it on a CPU, and
    # bench/vllm_w4a8.py runs the same check with the platform answered as an H100.
    from qconvert.schemes.servers import YES, servers

    source, out = w4a8_folder(family, tmp_path, capsys)
    alone = subprocess.run([str(VENV_PYTHON), CHECK.name, str(out)], cwd=CHECK.parent, capture_output=True,
                           text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert verdict_of(alone.stdout) == "REFUSE" and "No compressed-tensors compatible scheme" in alone.stdout
    done = subprocess.run([str(VENV_PYTHON), str(ROOT / "bench" / "vllm_w4a8.py"), str(out), "--ref", str(source),
                           "--accept", str(CHECK)], capture_output=True, text=True,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert verdict_of(done.stdout) == "OK", done.stdout[-3000:]
    assert "CompressedTensorsW4A8Fp8" in done.stdout and "bit for bit" in done.stdout
    assert servers("w4a8-fp8", family)["vLLM GPU"] == YES


@pytest.mark.slow
@needs_vllm_tpu
@pytest.mark.parametrize("family", sorted(W4A8_SOURCES))
def test_vllm_tpu_loads_w4a8_fp8_where_the_servers_table_says(family, tmp_path, capsys):
    from qconvert.schemes.servers import YES, servers

    _, out = w4a8_folder(family, tmp_path, capsys)
    recorded = servers("w4a8-fp8", family)
    done = subprocess.run([str(TPU_PYTHON), str(ROOT / "bench" / "vllm_tpu_w4a8.py"), str(out), "--impl", "vllm",
                           "--accept", str(TPU_CHECK)], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert recorded["vLLM TPU MODEL_IMPL_TYPE=vllm"] == YES
    assert verdict_of(done.stdout) == "OK", done.stdout[-3000:]
    auto = subprocess.run([str(TPU_PYTHON), TPU_CHECK.name, str(out), "--impl", "auto"], cwd=TPU_CHECK.parent,
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    # tpu_accept.py maps no W4A8 array (it calls their values wrong); where auto does not reach them it refuses.
    assert (verdict_of(auto.stdout) == "REFUSE") == (recorded["vLLM TPU"] != YES), auto.stdout[-3000:]


ZERO_POINTS = ROOT / "bench" / "vllm_zero_points.py"


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("rounding", ["rtn", "gptq"])
def test_vllm_loads_int4_folders_with_zero_points(family, rounding, tmp_path, capsys):
    """vllm_accept.py's checks with vLLM's reading of weight_zero_point (bench/vllm_zero_points.py): its WNA16
    scheme and WNA16 MoE method load the folder and read (q - z) * s as compressed-tensors decompresses it."""
    source = bf16_source(tmp_path / "src", family)
    out = tmp_path / f"int4-asym-{rounding}"
    flags = CALIB if rounding == "gptq" else ["--no-gptq", "--no-awq"]
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "int4-asym", "-q", *flags], capsys)
    assert code == 0, err
    ref = ["--ref", str(source)] if rounding == "rtn" else []
    done = subprocess.run([str(VENV_PYTHON), str(ZERO_POINTS), str(out), *ref, "--check", str(CHECK)],
                          capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert verdict_of(done.stdout) == "OK", done.stdout[-3000:]
    assert "OK          dequant.vs_compressed_tensors" in done.stdout
