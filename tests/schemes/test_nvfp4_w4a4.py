"""--scheme nvfp4 (compressed-tensors NVFP4, W4A4): the input_global_scale is compressed-tensors' own generate_gparam
of the calibrated max|x| bit for bit, the activations verify rounds are compressed-tensors' fake quantization of
them, the weights are nvfp4a16's (compressed-tensors' compressor with the fused shards' joint global scale), the
config is the NVFP4 preset's, and a tiny Llama and Qwen3-MoE pass verify, which a wrong input scale fails."""

from __future__ import annotations

import base64
import hashlib
import json

import ml_dtypes
import numpy as np
import pytest

from cli_helpers import run as run_cli
from fp4_references import compressed_tensors_fp4, torch_weight
from qconvert.schemes import scheme_named
from qconvert.schemes.nvfp4_w4a4 import nvfp4_activations, nvfp4_input_global_scale, round_nvfp4_activations

pytest.importorskip("compressed_tensors")

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32]
CALIB = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "16"]


def generate_gparam(absmax: float, dtype) -> float:
    """compressed-tensors' global scale of activations whose observed min/max are -absmax/absmax in `dtype`."""
    from compressed_tensors.quantization.utils import generate_gparam as theirs

    t = torch_weight(np.array([absmax], np.float32).astype(dtype))
    return float(theirs(-t, t).item())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_input_global_scale_is_generate_gparams_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    values = [0.0, 1e-30, 1e-8, 2.0 ** -14, 0.5, 1.0, 3.0, 448.0, 2688.0, 6e4, 1e30,
              *np.exp(rng.uniform(-12, 12, 400))]
    for absmax in values:
        with np.errstate(over="ignore"):
            representable = np.isfinite(np.float32(absmax).astype(dtype))
        if not representable:
            continue  # a float16 activation cannot exceed 65504
        ours = nvfp4_input_global_scale(absmax, dtype)
        assert np.float32(ours).tobytes() == np.float32(generate_gparam(absmax, dtype)).tobytes(), absmax


def awkward_activations(rows=24, cols=256, seed=1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :16] = 0.0                      # a zero group
    x[1, 3] = 40.0                       # an outlier past the calibrated maximum: E4M3's 448 clamps its group
    x[2] *= 1e-3                         # a quiet token: its group scales fall to E4M3's subnormals
    x[3, :16] = np.array([6, 0.25, -0.25, 0.75, -1.25, 1.75, 2.5, -3.5, 5, -5, 0.1, -0.0, 1, 2, 3, 4]) / 2
    return x.astype(ml_dtypes.bfloat16)


def test_the_folder_activations_are_compressed_tensors_fake_quantization():
    """vLLM's rounding of NVFP4 activations (nvfp4_activations) against compressed-tensors' own dynamic
    tensor_group fake quantization with the same input global scale, and the jnp rounding verify's kernels take."""
    import torch
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    x = awkward_activations()
    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    for absmax in (4.0, 3.3, 0.5):
        g = generate_gparam(absmax, ml_dtypes.bfloat16)
        global_scale = torch.tensor([g], dtype=torch.float32)
        t = torch_weight(x).float()
        scale, zero = compute_dynamic_scales_and_zp(t, args, torch.nn.Module(), global_scale=global_scale)
        theirs = fake_quantize(t, scale, zero, args, global_scale=global_scale).numpy().astype(np.float64)
        codes, row = nvfp4_activations(np.asarray(x, np.float32), g)
        ours = codes * row
        np.testing.assert_allclose(ours, theirs, rtol=2 ** -20, atol=0)
        kernel = np.asarray(round_nvfp4_activations(np.asarray(x, np.float32), g), np.float64)
        np.testing.assert_allclose(kernel, theirs, rtol=2 ** -20, atol=0)


def test_fused_shards_share_and_an_expert_no_token_reached_takes_its_layers_largest():
    scheme = scheme_named("nvfp4")
    absmax = {"l.self_attn.q_proj": 2.0, "l.self_attn.k_proj": 2.0, "l.self_attn.v_proj": 2.5,
              "l.self_attn.o_proj": 1.0, "l.mlp.experts.0.gate_proj": 3.0, "l.mlp.experts.1.gate_proj": 0.0,
              "l.mlp.experts.2.gate_proj": 5.0, "l.mlp.experts.1.up_proj": 0.0, "l.mlp.experts.0.up_proj": 3.0,
              "l.mlp.experts.1.down_proj": 0.0, "l.mlp.experts.0.down_proj": 7.0}
    dtype = np.dtype(ml_dtypes.bfloat16)
    scales = scheme.input_scales(absmax, {m: dtype for m in absmax})
    want = {"l.self_attn.q_proj": 2.5, "l.self_attn.k_proj": 2.5, "l.self_attn.v_proj": 2.5,
            "l.self_attn.o_proj": 1.0, "l.mlp.experts.0.gate_proj": 3.0, "l.mlp.experts.1.gate_proj": 5.0,
            "l.mlp.experts.2.gate_proj": 5.0, "l.mlp.experts.1.up_proj": 5.0, "l.mlp.experts.0.up_proj": 3.0,
            "l.mlp.experts.1.down_proj": 7.0, "l.mlp.experts.0.down_proj": 7.0}
    assert scales == {m: generate_gparam(a, dtype) for m, a in want.items()}


def folder_tensors(out) -> dict:
    from safetensors.torch import load_file

    return {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}


def calibrated_absmax(source, tmp_path, capsys) -> dict[str, float]:
    """Each linear's max|x| as the calibration engine finds it on the same text (`qconvert calibrate`)."""
    from qconvert.formats.act_stats import load_act_stats

    stats_file = tmp_path / "stats.safetensors"
    code, _, err = run_cli(["calibrate", str(source), "-o", str(stats_file), *CALIB, "-q"], capsys)
    assert code == 0, err
    stats = load_act_stats(stats_file)
    return {m: stats.tensor_absmax(m) for m in stats.act_absmax}


def test_a_llama_folder_is_the_nvfp4_presets_and_compressed_tensors_bytes(tmp_path, capsys):
    import torch
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=128, layers=1, dtype="bfloat16")
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "NVFP4", *CALIB, "-q"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    group, want = parsed.config_groups["group_0"], preset_name_to_scheme("NVFP4", ["Linear"])
    assert group.input_activations == want.input_activations
    assert group.weights.model_copy(update={"observer": None}) == want.weights.model_copy(update={"observer": None})
    assert parsed.format == "nvfp4-pack-quantized"
    folder, absmax = folder_tensors(out), calibrated_absmax(source, tmp_path, capsys)
    weights = {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in folder_tensors(source).items()}
    prefix = "model.layers.0."
    for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj",), ("mlp.down_proj",)):
        joint = max(float(np.abs(weights[f"{prefix}{m}.weight"].astype(np.float32)).max()) for m in fused)
        t = torch.tensor([joint], dtype=torch.bfloat16)
        from compressed_tensors.quantization.utils import generate_gparam as gparam

        for m in fused:
            theirs = compressed_tensors_fp4(weights[f"{prefix}{m}.weight"], "NVFP4", global_scale=gparam(-t, t))
            for key, value in theirs.items():
                got = folder[f"{prefix}{m}.{key}"]
                got = got.view(torch.uint8).numpy() if got.dtype == torch.float8_e4m3fn else got.numpy()
                assert got.tobytes() == value.tobytes(), (m, key)
            stored = folder[f"{prefix}{m}.input_global_scale"]
            assert stored.dtype == torch.float32 and tuple(stored.shape) == (1,)
            inputs = max(absmax[f"{prefix}{n}"] for n in fused)
            assert stored.item() == generate_gparam(inputs, ml_dtypes.bfloat16), m


def test_awq_and_gptq_scale_the_inputs_the_linears_see(tmp_path, capsys):
    """With AWQ's scales folded, a linear sees x / s: its input_global_scale is generate_gparam of max|x / s|
    (the scales qconvert.json records), and the folder passes verify."""
    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=128, layers=1, dtype="bfloat16",
                                peaked=True)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nvfp4", "--awq", "--gptq", *CALIB,
                            "-q"], capsys)
    assert code == 0, err
    from qconvert.formats.act_stats import load_act_stats

    stats_file = tmp_path / "stats.safetensors"
    assert run_cli(["calibrate", str(source), "-o", str(stats_file), *CALIB, "-q"], capsys)[0] == 0
    stats = load_act_stats(stats_file)
    record = json.loads((out / "qconvert.json").read_text())
    smoothing = record["smoothing"]
    assert smoothing["encoding"] == "float32-le-base64"
    smoothed = {}
    for source, linears in smoothing["groups"].items():
        scales = smoothing["scales"][source]
        encoded = scales.get("input_scales", scales["source_scales"])
        smoothed.update({m: np.frombuffer(base64.b64decode(encoded), "<f4") for m in linears})
    assert smoothed, record["smoothing"]
    folder = folder_tensors(out)
    for module, scales in smoothed.items():
        sees = float(np.max(np.asarray(stats.act_absmax[module], np.float32) / scales))
        assert folder[f"{module}.input_global_scale"].item() == generate_gparam(sees, ml_dtypes.bfloat16), module
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0 and json.loads(report)["passed"], err


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_verify_passes_and_fails_a_wrong_input_global_scale(family, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from hf_checkpoints import make_hf_checkpoint

    sizes = dict(moe_intermediate_size=64, peaked=True) if family == "qwen3_moe" else {}
    source = make_hf_checkpoint(tmp_path / "src", family, hidden=128, intermediate=128, layers=1, dtype="bfloat16",
                                **sizes)
    out = tmp_path / "out"
    assert run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nvfp4", *CALIB, "-q"], capsys)[0] == 0
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    record = json.loads(report)
    assert code == 0 and record["passed"], err
    assert min(layer["fidelity_sqnr_db"] for layer in record["layers"]) >= 40
    [shard] = sorted(out.glob("*.safetensors"))
    tensors = folder_tensors(out)
    name = "model.layers.0.self_attn.o_proj.input_global_scale"
    tensors[name] = tensors[name] * 1024  # every group scale of its activations clamps at E4M3's 448
    save_file(tensors, str(shard), metadata={"format": "pt"})
    # Recorded as the conversion's own, so that verify judges the numbers rather than the file's hash.
    record = json.loads((out / "qconvert.json").read_text())
    record["files"][shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "qconvert.json").write_text(json.dumps(record, indent=2))
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 1 and not json.loads(report)["passed"]
    assert "model.layers.0.self_attn.o_proj" in err
    assert torch.equal(folder_tensors(out)[name], tensors[name])


def test_static_activations_and_smoothing_flags_are_usage_errors(tmp_path, capsys):
    from hf_checkpoints import make_hf_checkpoint

    source = make_hf_checkpoint(tmp_path / "src", "llama", hidden=64, intermediate=128, layers=1)
    capsys.readouterr()
    for extra in (["--act", "static"], ["--alpha", "0.5"], ["--no-smooth"]):
        code, _, err = run_cli(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "nvfp4", *extra],
                               capsys)
        assert code == 2 and err.count("\n") == 1 and "--scheme nvfp4" in err, (extra, err)
