"""vLLM 0.33's own loading code judges nvfp4a16, nvfp4 and mxfp4a16 folders of dense families and an MoE one
(bench/vllm_fp4.py: vllm_accept.py with the GPU kernel choice a CPU lacks answered by a stub), a folder with one
scale changed is caught, and the servers table says what vLLM says. They run only where the vLLM venv was built
(bash ../shared/vllm/setup_venv.sh .vllm-venv); `pytest -m vllm` runs them alone."""

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
BENCH = ROOT / "bench" / "vllm_fp4.py"
SOURCES = {"llama": dict(hidden=128, intermediate=256, layers=1),
           "qwen3": dict(hidden=128, intermediate=256, layers=1),
           "qwen3_moe": dict(hidden=128, intermediate=128, layers=1, moe_intermediate_size=64)}
CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(
    not (VENV_PYTHON.exists() and CHECK.exists()),
    reason="vLLM's check needs .vllm-venv and ../shared/vllm/vllm_accept.py (bash ../shared/vllm/setup_venv.sh .vllm-venv)")]


def judged(out, ref=None) -> str:
    done = subprocess.run([str(VENV_PYTHON), str(BENCH), str(out), *(["--ref", str(ref)] if ref else []),
                           "--accept", str(CHECK)], capture_output=True, text=True,
                          env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    return done.stdout


def verdict(stdout: str) -> str:
    return next(line.split()[1] for line in reversed(stdout.splitlines()) if line.startswith("VERDICT"))


def folder(family, scheme, tmp_path, capsys):
    source = make_hf_checkpoint(tmp_path / "src", family, dtype="bfloat16", **SOURCES[family])
    out = tmp_path / scheme
    # Round-to-nearest, as llm-compressor's QuantizationModifier writes these presets (--ref checks the nearest value).
    calib = [*CALIB, "--no-gptq"] if scheme == "nvfp4" else ["--no-gptq"]
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme, *calib, "-q"], capsys)
    assert code == 0, err
    return source, out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("scheme", ["mxfp4a16", "nvfp4a16"])
def test_vllm_reads_every_fp4_weight_as_compressed_tensors_does(family, scheme, tmp_path, capsys):
    from qconvert.schemes.servers import UNMEASURED, YES, servers

    source, out = folder(family, scheme, tmp_path, capsys)
    stdout = judged(out, source)
    # Every layer and expert, q/k/v and gate/up sharing one NVFP4 global scale as vLLM applies one per fused layer.
    assert "OK          dequant.vs_compressed_tensors" in stdout and "bit for bit" in stdout, stdout[-3000:]
    assert "OK          ref.fp4_vs_float" in stdout, stdout[-3000:]
    recorded = servers(scheme, family)["vLLM GPU"]
    if recorded == YES:
        assert verdict(stdout) == "OK", stdout[-3000:]
    else:
        # vLLM's NVFP4 MoE method registers w13/w2_input_global_scale whatever the config, which a weight-only
        # checkpoint has none of: they stay unwritten (its W4A16 backend, Marlin, does not read them).
        assert (scheme, family, recorded) == ("nvfp4a16", "qwen3_moe", UNMEASURED)
        assert verdict(stdout) == "WRONG" and "FAIL-WRONG  params.all_written" in stdout
        assert "w13_input_global_scale(4, 2):100% unset" in stdout and "w2_input_global_scale(4,):100% unset" in stdout


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_vllm_reads_nvfp4_w4a4_folders_with_one_input_global_scale_a_fused_layer(family, tmp_path, capsys):
    from qconvert.schemes.servers import YES, servers

    source, out = folder(family, "nvfp4", tmp_path, capsys)
    stdout = judged(out, source)
    assert "OK          dequant.vs_compressed_tensors" in stdout and "bit for bit" in stdout, stdout[-3000:]
    assert "OK          input_global_scale.fused" in stdout, stdout[-3000:]
    assert verdict(stdout) == "OK", stdout[-3000:]
    assert servers("nvfp4", family)["vLLM GPU"] == YES


VLLM_ROUNDING = """
import sys, numpy as np, torch
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant
data = np.load(sys.argv[1])
codes, scale = ref_nvfp4_quant(torch.from_numpy(data["x"]), torch.tensor([float(data["g"])], dtype=torch.float32), 16)
np.savez(sys.argv[2], values=codes.numpy(), scale=scale.float().numpy())
"""


def test_the_activation_rounding_verify_takes_is_vllms_own(tmp_path):
    """nvfp4_activations (verify's float64 reference of an nvfp4 linear) against vLLM's ref_nvfp4_quant, the
    rounding its NVFP4 emulation runs: the same E2M1 values and E4M3 group scales."""
    import numpy as np

    from qconvert.schemes.nvfp4_w4a4 import nvfp4_activations

    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 256)).astype(np.float32) * np.exp(rng.uniform(-6, 3, (32, 1))).astype(np.float32)
    x[0, :16], x[1, 5] = 0.0, 300.0  # a zero group; an outlier past the calibrated max, its group clamped
    for absmax in (4.0, 0.01, 50.0):
        g = np.float32(2688.0) / np.float32(absmax)
        np.savez(tmp_path / "in.npz", x=x, g=g)
        done = subprocess.run([str(VENV_PYTHON), "-c", VLLM_ROUNDING, str(tmp_path / "in.npz"),
                               str(tmp_path / "out.npz")], capture_output=True, text=True,
                              env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        assert done.returncode == 0, done.stderr[-2000:]
        theirs = np.load(tmp_path / "out.npz")
        ours, row = nvfp4_activations(x, float(g))
        want = theirs["values"].astype(np.float64).reshape(32, 16, 16) * theirs["scale"].astype(np.float64)[..., None]
        np.testing.assert_array_equal(ours, want.reshape(32, 256))
        assert np.all(row == 1.0 / np.float64(g))


def test_one_changed_input_global_scale_is_caught(tmp_path, capsys):
    """q_proj's input global scale doubled: vLLM would take the largest of q/k/v's for the whole fused layer."""
    from safetensors.torch import load_file, save_file

    _, out = folder("llama", "nvfp4", tmp_path, capsys)
    [shard] = sorted(out.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.0.self_attn.q_proj.input_global_scale"
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(shard), metadata={"format": "pt"})
    stdout = judged(out)
    assert verdict(stdout) == "WRONG" and "FAIL-WRONG  input_global_scale.fused" in stdout, stdout[-3000:]


def test_per_tensor_global_scales_on_fused_layers_are_read_wrong(tmp_path, capsys):
    # What --gptq's folders hold (each linear rounded with its own global scale), made here by hand: vLLM's check
    # must see that it applies one global scale to a fused layer whose shards were quantized with others.
    import ml_dtypes
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from qconvert.formats.layout_base import LayoutFlags
    from qconvert.schemes import scheme_named

    source, out = folder("llama", "nvfp4a16", tmp_path, capsys)
    [shard] = sorted(out.glob("*.safetensors"))
    tensors = load_file(str(shard))
    weights = load_file(str(next(source.glob("*.safetensors"))))
    scheme = scheme_named("nvfp4a16")
    for m in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{m}"
        w = weights[f"{name}.weight"].float().numpy().astype(ml_dtypes.bfloat16)
        own = scheme.layout.to_tensors(name, scheme.quantize(w, LayoutFlags(), scale_dtype=None), LayoutFlags())
        for key, value in own.items():
            value = torch.from_numpy(np.ascontiguousarray(value.view(np.uint8) if value.dtype == ml_dtypes.float8_e4m3fn
                                                          else value))
            tensors[key] = value.view(torch.float8_e4m3fn) if tensors[key].dtype == torch.float8_e4m3fn else value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    stdout = judged(out, source)
    assert verdict(stdout) == "WRONG" and "FAIL-WRONG  dequant.vs_compressed_tensors" in stdout, stdout[-3000:]


def test_one_changed_scale_is_caught(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    source, out = folder("llama", "mxfp4a16", tmp_path, capsys)
    [shard] = sorted(out.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 1] += 1  # one group's power-of-two scale doubled
    save_file(tensors, str(shard), metadata={"format": "pt"})
    stdout = judged(out, source)
    assert verdict(stdout) == "WRONG" and "FAIL-WRONG  ref.fp4_vs_float" in stdout, stdout[-3000:]
    assert torch.equal(load_file(str(shard))[name], tensors[name])


def test_gptq_folders_share_the_fused_layers_global_scale_as_vllm_reads_it(tmp_path, capsys):
    """nvfp4a16 with --gptq: q/k/v and gate/up rounded on one global scale each fused layer, which vLLM reads bit
    for bit (the codes are GPTQ's, so the nearest-E2M1 check does not apply)."""
    source = make_hf_checkpoint(tmp_path / "src", "llama", dtype="bfloat16", **SOURCES["llama"])
    out = tmp_path / "gptq"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nvfp4a16", "--gptq", "--calib",
                            "random", "--calib-samples", "4", "--calib-seqlen", "16", "-q"], capsys)
    assert code == 0, err
    stdout = judged(out)
    assert "OK          dequant.vs_compressed_tensors" in stdout and "bit for bit" in stdout, stdout[-3000:]
    assert verdict(stdout) == "OK", stdout[-3000:]
