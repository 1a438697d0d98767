"""Qwen3, Phi-3, Qwen2-MoE and Qwen3-MoE end to end: tiny models built by transformers convert to
int8, nf4 and w8a8, pass `qconvert verify`, load back with qconvert.load, and the int8 weights as
compressed-tensors decompresses them give transformers the float logits within int8 error."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cli_helpers import run as run_cli
import qconvert
from hf_checkpoints import load_config, make_hf_checkpoint, reference_logits, token_batch
from quantize_reference import numpy_int8
from qconvert.cli.main import main
from qconvert.models import build
from qconvert.models.registry import family_for

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

FAMILIES = ("qwen3", "phi3", "qwen2_moe", "qwen3_moe")
# Cosine of the loaded folder's logits with transformers' float logits, per scheme
# (measured on these models: >= 0.9999 int8, >= 0.9998 w8a8, >= 0.996 nf4).
MIN_COSINE = {"int8": 0.999, "w8a8": 0.998, "nf4": 0.98}


@pytest.fixture(scope="module", params=FAMILIES)
def source(request, tmp_path_factory):
    # One layer keeps verify's per-layer kernel compiles few. Peaked next-token distributions
    # (as trained LMs have) make verify's top-1 agreement meaningful: with near-uniform ones
    # (perplexity above the vocabulary size) NF4's noise flips a coin on many tokens.
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "src", request.param, layers=1,
                              peaked=True)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("scheme", ["int8", "nf4", "w8a8"])
def test_converts_verifies_and_loads_back(source, scheme, tmp_path, capsys):
    out = tmp_path / scheme
    calib = ["--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"] if scheme == "w8a8" else []
    config = load_config(source)
    # nf4 refuses experts (transformers' bitsandbytes keeps them float): they are kept float here.
    float_experts = scheme == "nf4" and config["model_type"].endswith("_moe")
    exclude = ["--exclude", "*.experts.*"] if float_experts else []
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", scheme, "--quiet", *calib,
                            *exclude], capsys)
    assert code == 0, err

    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    record = json.loads(report)
    linears = family_for(config).linear_names(load_file(str(source / "model.safetensors")))
    assert sorted(r["name"] for r in record["layers"]) == [m for m in linears
                                                           if not (float_experts and ".experts." in m)]
    assert record["model"]["mean_kl"] is not None

    model = build(qconvert.load_config(out))
    params = qconvert.flatten_params(qconvert.load(out))
    ids, mask = token_batch(config["vocab_size"])
    logits = np.asarray(jax.jit(model.forward)(params, ids, mask))
    expected = reference_logits(source, ids, mask)
    valid = mask.astype(bool)
    assert cosine(logits[valid], expected[valid]) >= MIN_COSINE[scheme]


def test_int8_weights_decompressed_by_compressed_tensors_give_transformers_the_float_logits(source, tmp_path):
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file as load_torch

    out = tmp_path / "int8"
    assert main_quantize(source, out) == 0
    config = load_config(source)
    quantization = QuantizationConfig.model_validate(
        json.loads((out / "config.json").read_text())["quantization_config"])
    stored = load_torch(str(out / "model.safetensors"))
    weights = load_file(str(source / "model.safetensors"))
    linears = family_for(config).linear_names(weights)
    for m in linears:
        state = {k: stored[f"{m}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        dequantized = PackedQuantizationCompressor.decompress(state, quantization.config_groups["group_0"])
        q, scale = numpy_int8(weights[f"{m}.weight"], np.float32)
        np.testing.assert_array_equal(dequantized["weight"].numpy(), q.astype(np.float32) * scale)
        weights[f"{m}.weight"] = dequantized["weight"].numpy()

    fake = tmp_path / "dequantized"
    fake.mkdir()
    shutil.copy(source / "config.json", fake / "config.json")
    save_file(weights, str(fake / "model.safetensors"))
    ids, mask = token_batch(config["vocab_size"])
    float_logits = reference_logits(source, ids, mask)
    int8_logits = reference_logits(fake, ids, mask)
    valid = mask.astype(bool)
    err = np.abs(int8_logits[valid] - float_logits[valid])
    # Per-channel int8 leaves each weight within scale/2 = absmax/254: a few tenths of a
    # percent per layer; the logits move by 0.7-1.1% of their scale here (measured), under 2%.
    assert 0 < err.max() <= 0.02 * np.abs(float_logits[valid]).max()
    assert (int8_logits[valid].argmax(-1) == float_logits[valid].argmax(-1)).mean() >= 0.9


def main_quantize(source, out) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", str(source), "-o", str(out), "--scheme", "int8", "--quiet"])
    return exit_info.value.code


def test_w8a8_smoothing_keeps_the_float_model_and_smooths_fused_slices(source):
    from qconvert.options import ConvertOptions, CalibrationOptions
    from qconvert.source.resolve import open_source, resolve_source
    from qconvert.methods.recipe import prepare_adjustments

    config = load_config(source)
    raw = load_file(str(source / "model.safetensors"))
    options = ConvertOptions(scheme="w8a8", calibration=CalibrationOptions(calib="random", calib_samples=4, calib_seqlen=16))
    adjustments = prepare_adjustments(open_source(resolve_source(str(source))), options)
    smoothed = {name: adjustments.weight_transform(name, array) for name, array in raw.items()}
    model = build(config)
    ids, mask = token_batch(config["vocab_size"])
    forward = jax.jit(model.forward)
    reference = np.asarray(forward(raw, ids, mask))
    valid = mask.astype(bool)
    got = np.asarray(forward(smoothed, ids, mask))
    assert np.abs(got[valid] - reference[valid]).max() <= 1e-4 * np.abs(reference[valid]).max()
    if config["model_type"] == "phi3":
        # Only the value rows of qkv_proj and the up rows of gate_up_proj were divided by s.
        a = model.args
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        fold = adjustments.folds[qkv]
        assert fold.row_offset == (a.num_attention_heads + a.num_key_value_heads) * a.head_dim
        assert len(fold.row_divisor) == a.num_key_value_heads * a.head_dim
        ratio = smoothed[qkv] / (raw[qkv] * fold.col_multiplier[None, :])
        np.testing.assert_allclose(ratio[: fold.row_offset], 1.0, rtol=1e-6)
        np.testing.assert_allclose(ratio[fold.row_offset:], 1 / fold.row_divisor[:, None] * np.ones_like(
            ratio[fold.row_offset:]), rtol=1e-6)
        assert adjustments.folds["model.layers.0.mlp.gate_up_proj.weight"].row_offset == a.intermediate_size
