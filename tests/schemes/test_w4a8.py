"""--scheme w4a8-fp8 (compressed-tensors W4AFP8): int4's weight bytes, the preset's config, the kernels against
float64, folders of five families through verify and transformers + compressed-tensors, and its refusals.

transformers + compressed-tensors runs the folder's FP8 activations on CPU: each quantized linear's input is
rounded to E4M3 per token in its forward, so "as meant" is the float model holding qconvert's dequantized
weights with that rounding hooked in (test_fp8_families.meant_logits, written from the format's definition)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme

from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli, tree
from hf_checkpoints import (dequantized_float_folder, family_source, load_config, make_hf_checkpoint,
                            reference_logits, token_batch)
from peer_references import meant_logits
from peer_references import compressed_tensors_int4
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layouts import layout_for, open_quantized
from qconvert.formats.qarray import QArray
from qconvert.kernels import qgrouped_linear, qlinear, w4a8_fp8_matmul
from qconvert.schemes import scheme_named
from qconvert.schemes.int4 import quantize_int4


def test_weight_bytes_are_int4s_and_compressed_tensors_round_to_nearest():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((256, 1536)) * 0.02).astype(ml_dtypes.bfloat16)
    w[3, 5] = 1.5
    scheme = scheme_named("w4a8-fp8")
    flags = scheme.layout_flags(shapes={"m": w.shape})
    assert flags.group_size == 128
    q = scheme.quantize(w, flags, scale_dtype=w.dtype)
    codes, scale = compressed_tensors_int4(w, 128)
    np.testing.assert_array_equal(np.asarray(q.qvalue), codes)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale)
    ours = scheme.layout.to_tensors("m", q, flags)
    int4s = layout_for("int4").to_tensors("m", quantize_int4(w, 128), LayoutFlags(group_size=128))
    assert list(ours) == list(int4s)
    for name in ours:
        assert ours[name].tobytes() == int4s[name].tobytes()
    np.testing.assert_array_equal(ours["m.weight_packed"], pack_to_int32(torch.from_numpy(codes), 4).numpy())


def test_the_quantization_config_is_the_w4afp8_preset(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "w4a8"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "W4A8-FP8".lower(), "-q",
                            "--no-gptq", "--no-awq"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    preset = preset_name_to_scheme("W4AFP8", ["Linear"])
    group = parsed.config_groups["group_0"]
    # Every field but the weights' observer (how the scales were found: min/max, as llm-compressor records it).
    assert group.weights.model_copy(update={"observer": None}) == preset.weights
    assert group.weights.observer == "minmax"
    assert group.input_activations == preset.input_activations
    assert group.targets == preset.targets and group.output_activations is None
    assert parsed.format == "pack-quantized" and group.format == "pack-quantized" and parsed.ignore == ["lm_head"]
    # Left to itself compressed-tensors infers int-quantized for this scheme (int weights with activations: an
    # int8 `weight` per linear), which vLLM's W4A8-FP8 methods do not read: the group names its format.
    assert infer_module_format(torch.nn.Linear, QuantizationScheme(targets=["Linear"], **preset.model_dump(
        include={"weights", "input_activations"}))).value == "int-quantized"
    stored = open_quantized(out).checkpoint
    assert stored.shape("model.layers.0.mlp.down_proj.weight_scale") == (128, 2)
    assert stored.dtype("model.layers.0.mlp.down_proj.weight_packed") == np.dtype(np.int32)


def e4m3_matmul_f64(x, codes, scale, group):
    """The format's meaning in float64: per-token E4M3 activations times the int4 weight, times the token scale."""
    xf = x.astype(np.float32)
    absmax = np.abs(xf).max(axis=1, keepdims=True)
    s = np.where(absmax > 0, absmax / np.float32(448), np.float32(1)).astype(np.float32)  # a zero token: 1
    x8 = np.clip(xf / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    w = codes.astype(np.float64) * np.repeat(scale.astype(np.float64), group, axis=1)
    return (x8 @ w.T) * s.astype(np.float64)


@pytest.mark.parametrize("backend", ["cpu", "xla"])  # the TPU kernels in interpret mode; the XLA contract
def test_dense_and_grouped_kernels_match_float64_at_real_k(backend):
    rng = np.random.default_rng(1)
    m, k, n, group = 16, 2048, 256, 128
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    x[:, 7] *= 30  # an outlier channel: each token's scale follows it
    x[5] = 0  # a zero token: scale 1, output 0
    qs = [QArray(qvalue=rng.integers(-8, 8, (n, k)).astype(np.int8),
                 scale=(rng.uniform(0.5, 1.5, (n, k // group)) * 1e-2).astype(ml_dtypes.bfloat16), kind="int4",
                 block_size=group, shape=(n, k), dtype="bfloat16") for _ in range(3)]
    bias = rng.standard_normal(n).astype(np.float32)
    want = e4m3_matmul_f64(x, np.asarray(qs[0].qvalue), np.asarray(qs[0].scale), group) + bias
    y, plan = qlinear(jnp.asarray(x), qs[0], bias, act="dynamic", out_dtype=jnp.float32, backend=backend,
                      return_plan=True)
    assert plan.is_pallas == (backend == "cpu")
    y = np.asarray(y, np.float64)
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()
    np.testing.assert_array_equal(y[5], np.float32(bias))
    sizes = [5, 0, 9]  # an empty expert; 2 rows past the last group are 0
    rows = np.split(np.asarray(x), np.cumsum(sizes))
    want = np.concatenate([e4m3_matmul_f64(r, np.asarray(q.qvalue), np.asarray(q.scale), group) if len(r) else
                           np.zeros((0, n)) for r, q in zip(rows, qs)] + [np.zeros((2, n))])
    y = np.asarray(qgrouped_linear(jnp.asarray(x), qs, sizes, act="dynamic", backend=backend), np.float64)
    assert np.abs(y - want).max() <= 2e-6 * np.abs(want).max()


def test_gptq_rounds_onto_int4s_grid():
    int4, w4a8 = scheme_named("int4"), scheme_named("w4a8-fp8")
    assert w4a8.gptq_grid() == int4.gptq_grid() and w4a8.default_gptq and w4a8.clip == int4.clip


def test_the_dense_path_lowers_for_tpu_and_gpu():
    # The int4 kernels take the E4M3 values as float32 tiles: Mosaic (v5e's MXU has no FP8) and Triton.
    s = jax.ShapeDtypeStruct
    args = (s((16, 1024), jnp.bfloat16), s((512, 1024), jnp.int8), s((512, 8), jnp.bfloat16))
    for backend, platform, mark in (("tpu", "tpu", "tpu_custom_call"), ("gpu", "cuda", "triton")):
        fn = functools.partial(w4a8_fp8_matmul, group_size=128, backend=backend, out_dtype=jnp.bfloat16)
        assert mark in jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


FAMILIES = ("llama", "qwen3", "gemma3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="module", params=FAMILIES)
def source(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_moe":  # experts wide enough for a group (the shared fixture's 24 takes none)
        return make_hf_checkpoint(root / "src", "qwen3_moe", hidden=128, layers=1, peaked=True, intermediate=128,
                                  moe_intermediate_size=128)
    return family_source(root, request.param)


def test_folders_pass_verify_and_load_in_transformers_as_meant(source, capsys, tmp_path):
    # GPTQ on one family (its grid is int4's, whose GPTQ every family's int4 test runs); the rest round to nearest.
    rounding = "gptq" if load_config(source)["model_type"] == "llama" else "rtn"
    out = tmp_path / "w4a8"
    extra = (["--no-awq", "--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"] if rounding == "gptq"
             else ["--no-gptq", "--no-awq"])
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "w4a8-fp8", "-q", *extra], capsys)
    assert code == 0, err
    record = json.loads((out / "qconvert.json").read_text())
    assert record["rounding"]["method"] == ("gptq" if rounding == "gptq" else "rtn")
    code, report, err = run_cli(["verify", str(out), "--quick", "--json", "-", "--max-ppl-ratio", "1.5"], capsys)
    assert code == 0, err
    report = json.loads(report)
    assert report["scheme"] == "w4a8-fp8" and report["passed"]
    assert min(layer["fidelity_sqnr_db"] for layer in report["layers"]) >= 40
    ids, mask = token_batch(load_config(source)["vocab_size"])
    loaded = reference_logits(out, ids, mask)  # transformers + compressed-tensors, FP8 activations per token
    modules = open_quantized(out).quantized_modules
    meant, hooked = meant_logits(dequantized_float_folder(source, out, tmp_path / "meant"), modules, ids, mask)
    assert hooked >= 4
    valid = mask.astype(bool)
    assert np.abs(loaded[valid] - meant[valid]).max() <= 1e-4 * np.abs(meant[valid]).max()
    float_logits = reference_logits(source, ids, mask)
    a, b = loaded[valid].ravel().astype(np.float64), float_logits[valid].ravel().astype(np.float64)
    assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.95
    code, shown, err = run_cli(["inspect", str(out), "--json"], capsys)
    assert code == 0, err
    assert json.loads(shown)["scheme"] == "w4a8-fp8"


@pytest.mark.parametrize("flags, words", [(["--group-size", "channel"], "needs group scales"),
                                          (["--act", "static"], "--act")])
def test_what_neither_server_loads_is_refused_in_one_line(flags, words, tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    before = tree(tmp_path)
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "w4a8-fp8", *flags],
                             capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err
    assert tree(tmp_path) == before


def test_a_group_vllm_on_gpu_refuses_is_said_in_one_line(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "w4a8-fp8", "--no-gptq",
                            "--no-awq", "--group-size", "64"], capsys)
    assert code == 0, err
    assert "w4a8-fp8: group size 64 (vLLM on GPU takes group 128 only): vLLM TPU loads it" in err


def test_experts_no_group_divides_are_refused_in_one_line(tmp_path, capsys):
    # The shared Qwen3-MoE fixture's experts are 24 wide: int4 falls back to one scale per output channel there,
    # which neither vLLM's nor vLLM TPU's W4A8 MoE method reads.
    src = make_hf_checkpoint(tmp_path / "src", "qwen3_moe", layers=1)
    capsys.readouterr()  # transformers' own progress while saving it
    before = tree(tmp_path)
    code, out, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "w4a8-fp8", "--no-gptq",
                             "--no-awq"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "needs group scales" in err
    assert tree(tmp_path) == before
