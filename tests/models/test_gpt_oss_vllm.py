"""vLLM 0.33's own loading code judges gpt-oss folders (bench/vllm_gpt_oss.py: vllm_accept.py taught gpt-oss's
names and its loader's direct copy of the fused float experts): int4, fp8, nvfp4a16, mxfp4a16, nvfp4 (W4A4), int8
and w8a8 folders load with every tensor where it belongs, the experts float and exactly the checkpoint's; one changed
scale and a loader that swaps gate and up are caught. Beside them, why the experts stay float: vLLM's fp8 and NVFP4
fused-MoE methods hold no expert bias, and its int4 method takes gpt-oss experts only under vLLM's own parameter
names, not under any compressed-tensors module name. They run only where the vLLM venv was built
(bash ../shared/vllm/setup_venv.sh .vllm-venv); `pytest -m vllm` runs them alone."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cli_helpers import run as run_cli
from gpt_oss_checkpoints import make_gpt_oss_checkpoint, write_int4_experts

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
CHECK = ROOT.parent / "shared" / "vllm" / "vllm_accept.py"
BENCH = ROOT / "bench" / "vllm_gpt_oss.py"
RTN = ("--no-awq", "--no-gptq")  # round-to-nearest: --ref holds each weight within half a step of the float one
CALIB = ("--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    not (VENV_PYTHON.exists() and CHECK.exists()),
    reason="vLLM's check needs .vllm-venv and ../shared/vllm/vllm_accept.py "
           "(bash ../shared/vllm/setup_venv.sh .vllm-venv)")]


def judged(out, *args) -> str:
    done = subprocess.run([str(VENV_PYTHON), str(BENCH), str(out), *map(str, args), "--accept", str(CHECK)],
                          capture_output=True, text=True, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    return done.stdout


def verdict(stdout: str) -> str:
    return next(line.split()[1] for line in reversed(stdout.splitlines()) if line.startswith("VERDICT"))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # 128 wide: vLLM's int4 MoE method (Marlin) takes no narrower hidden size.
    return make_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss") / "bf16", hidden=128, intermediate=128)


def quantized(source, tmp_path, capsys, scheme):
    out = tmp_path / scheme
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = RTN if scheme in ("int4", "fp8", "nvfp4a16", "mxfp4a16") else CALIB if scheme in ("nvfp4", "w8a8") else ()
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme, "-q", *flags], capsys)
    assert code == 0, err
    return out


REFS = {"int4": "ref.int4_vs_float", "fp8": "ref.fp8_vs_float", "nvfp4a16": "ref.fp4_vs_float",
        "mxfp4a16": "ref.fp4_vs_float", "nvfp4": "ref.fp4_vs_float", "int8": "ref.int8_vs_float", "w8a8": None}


@pytest.mark.parametrize("scheme", sorted(REFS))
def test_vllm_loads_the_quantized_attention_and_the_float_experts_as_written(source, tmp_path, capsys, scheme):
    stdout = judged(quantized(source, tmp_path, capsys, scheme), "--ref", source)
    assert verdict(stdout) == "OK", stdout[-3000:]
    for line in ("OK          ckpt.all_consumed", "OK          params.all_written", "OK          experts.fused_float",
                 "OK          dequant.vs_compressed_tensors"):
        assert line in stdout, stdout[-3000:]
    ref = REFS[scheme]  # w8a8's smoothed int8 weights are not compared with the float ones (vllm_accept.py)
    assert ref is None or f"OK          {ref}" in stdout and "4 weights" in stdout.split(ref, 1)[1].splitlines()[0], \
        stdout[-3000:]


def test_one_changed_scale_is_caught(source, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    out = quantized(source, tmp_path, capsys, "int4")
    shard = out / "model.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    tensors[name] = tensors[name].clone()
    tensors[name][5, 1] *= 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    stdout = judged(out, "--ref", source)
    assert verdict(stdout) == "WRONG" and "FAIL-WRONG  ref.int4_vs_float" in stdout, stdout[-3000:]
    assert torch.equal(load_file(str(shard))[name], tensors[name])


def test_a_loader_that_swaps_gate_and_up_is_caught(source, tmp_path, capsys):
    stdout = judged(quantized(source, tmp_path, capsys, "fp8"), "--sabotage", "experts")
    assert verdict(stdout) == "WRONG" and "FAIL-WRONG  experts.fused_float" in stdout, stdout[-3000:]
    assert "w13_weight differs from model.layers.0.mlp.experts.gate_up_proj transposed" in stdout


def experts_not_ignored(out):
    """`out` with its experts left out of the ignore list: vLLM builds them under the scheme's fused-MoE method."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["ignore"] = [i for i in config["quantization_config"]["ignore"] if "experts" not in i]
    path.write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("scheme, method", [("fp8", "CompressedTensorsW8A8Fp8MoEMethod"),
                                            ("nvfp4a16", "CompressedTensorsW4A4Nvfp4MoEMethod")])
def test_vllm_fp8_and_nvfp4_moe_methods_have_no_expert_bias(source, tmp_path, capsys, scheme, method):
    stdout = judged(experts_not_ignored(quantized(source, tmp_path, capsys, scheme)))
    [created] = [line for line in stdout.splitlines() if "create_weights" in line and "mlp.experts" in line]
    assert f"[{method}]" in created and "w13_weight_scale" in created and "_bias" not in created, created
    assert verdict(stdout) == "REFUSE", stdout[-3000:]


def test_vllm_takes_int4_experts_only_under_its_own_parameter_names(source, tmp_path, capsys):
    own = judged(write_int4_experts(quantized(source, tmp_path / "vllm", capsys, "int4"), "vllm"))
    # Every tensor taken; only the method's weight_shape parameters, which no checkpoint name reaches, stay unset.
    assert "OK          ckpt.all_consumed" in own, own[-3000:]
    [unset] = [line for line in own.splitlines() if "params.all_written" in line]
    assert unset.startswith("FAIL-WRONG") and "4 parameter(s)" in unset and unset.count("_weight_shape(") == 4
    # compressed-tensors modules (one fused gate_up_proj per expert, or llm-compressor's gate_proj, up_proj and
    # down_proj linears): the packed weights reach no parameter.
    for form, module in (("modules", "gate_up_proj"), ("linear", "gate_proj")):
        stdout = judged(write_int4_experts(quantized(source, tmp_path / form, capsys, "int4"), form))
        [dropped] = [line for line in stdout.splitlines() if "ckpt.all_consumed" in line]
        assert dropped.startswith("FAIL-WRONG") and f"experts.0.{module}.weight_packed" in dropped, stdout[-3000:]
