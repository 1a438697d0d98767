"""--scheme int4 against compressed-tensors itself: its round-to-nearest, its 4-bit packing, its W4A16 config."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import qconvert.schemes.rowwise as rowwise
from cli_helpers import run as run_cli
from checkpoints import make_llama_checkpoint
from peer_references import compressed_tensors_int4
from qconvert.formats.layouts import open_quantized
from qconvert.formats.packing import pack_int4_to_int32, unpack_int32_to_int4
from qconvert.schemes import scheme_named
from qconvert.schemes.int4 import int4_clip_search, quantize_int4


@pytest.mark.parametrize("shape, dtype, group", [
    ((576, 1536), ml_dtypes.bfloat16, 64),
    ((576, 1536), ml_dtypes.bfloat16, 128),
    ((256, 14336), ml_dtypes.bfloat16, 128),
    ((576, 1536), np.float16, 32),
    ((576, 1536), np.float32, None),
])
def test_codes_and_scales_equal_compressed_tensors_round_to_nearest(shape, dtype, group):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * 0.02).astype(dtype)
    w[0, : group or shape[1]] = 0  # an all-zero group: compressed-tensors puts its dtype's eps there
    w[3, 5] = 1.5  # an outlier
    codes, scale = compressed_tensors_int4(w, group)
    q = quantize_int4(w, group)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale)
    np.testing.assert_array_equal(np.asarray(q.qvalue), codes)
    assert np.asarray(q.scale).dtype == np.dtype(dtype)


int4_matrices = st.tuples(st.integers(1, 4), st.integers(1, 19)).flatmap(
    lambda shape: arrays(np.int8, shape, elements=st.integers(-8, 7)))


@settings(max_examples=25, deadline=None)
@given(int4_matrices)
def test_int4_packing_matches_compressed_tensors(q):
    packed = pack_int4_to_int32(q)
    np.testing.assert_array_equal(packed, pack_to_int32(torch.from_numpy(q), 4).numpy())
    np.testing.assert_array_equal(unpack_int32_to_int4(packed, q.shape[1]), q)
    np.testing.assert_array_equal(unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(q.shape)).numpy(), q)


def test_int4_packing_hand_worked_case():
    # u = q + 8: 0, 7, 8, 15, 9, 1, 2, 3 -> nibbles from the least significant: 0x32197F80... read backwards.
    q = np.array([[-8, -1, 0, 7, 1, -7, -6, -5, 4]], dtype=np.int8)
    packed = pack_int4_to_int32(q)
    assert packed.shape == (1, 2)
    assert packed[0, 0] == np.int32(np.uint32(0x3219F870).view(np.int32))
    assert packed[0, 1] == 0xC  # the ninth code (4 + 8) alone; the unused nibbles are 0


def test_streamed_rows_give_the_whole_tensor_quantization(monkeypatch):
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 3_000)
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((37, 256)) * 0.05).astype(ml_dtypes.bfloat16)
    scheme = scheme_named("int4")
    flags = scheme.layout_flags(group_size=64, shapes={"m": w.shape})
    streamed = scheme.quantize_rows(lambda a, b: w[a:b], w.shape, w.dtype, flags)
    whole = quantize_int4(w, 64)
    np.testing.assert_array_equal(streamed.qvalue, whole.qvalue)
    np.testing.assert_array_equal(np.asarray(streamed.scale), np.asarray(whole.scale))


def test_clip_search_never_does_worse_than_the_plain_scale():
    rng = np.random.default_rng(2)
    w = rng.standard_t(3, (64, 512)).astype(np.float32)  # heavy tails: clipping pays
    found = int4_clip_search(w, 128)
    assert found.ratios.shape == (64, 4) and found.ratios.max() == 1.0
    assert found.error_searched < found.error_plain

    def error(clip):
        q = quantize_int4(w, 128, clip=clip)
        return float(((np.asarray(q.dequantize(np.float32)) - w) ** 2).sum())

    assert error(found.ratios) < error(None)


def test_the_quantization_config_is_the_compressed_tensors_w4a16_preset(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "int4"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "int4", "--no-gptq", "--no-awq", "-q"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)
    preset = preset_name_to_scheme("W4A16", ["Linear"])
    group = parsed.config_groups["group_0"]
    # Every field but the observer, which names how the scales were found (min/max, as llm-compressor
    # records it in its folders), not how a loader reads them.
    assert group.weights.model_copy(update={"observer": None}) == preset.weights
    assert group.weights.observer == "minmax" and group.input_activations is None
    assert parsed.format == "pack-quantized" and parsed.ignore == ["lm_head"]
    record = json.loads((out / "qconvert.json").read_text())
    assert record["flags"]["group_size"] == 128
    folder = open_quantized(out)
    q = folder.qarray("model.layers.0.mlp.down_proj")
    assert q.shape == (128, 256) and np.shape(q.scale) == (128, 2)


@pytest.mark.parametrize("intermediate, group, note", [
    (192, 64, "int4: group size 64 (128 does not divide every input width)"),
    (96, 32, "int4: group size 32 (128 does not divide every input width)"),
])
def test_the_default_group_size_falls_back_and_says_so(tmp_path, capsys, intermediate, group, note):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=intermediate)
    out = tmp_path / "int4"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "int4", "--no-gptq", "--no-awq"], capsys)
    assert code == 0, err
    assert f"qconvert: {note}" in err
    assert json.loads((out / "qconvert.json").read_text())["flags"]["group_size"] == group
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert weights["weights"]["group_size"] == group


def test_a_group_size_that_does_not_divide_is_a_usage_error(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=192)
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "int4", "--no-gptq", "--no-awq",
                            "--group-size", "128"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == ("qconvert: error: --group-size 128 does not divide model.layers.0.mlp.down_proj's "
                                            "input width 192; use 64 or 32 or channel")
    assert not (tmp_path / "o").exists()


def test_per_channel_int4_writes_one_scale_per_row(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=64, intermediate=96)
    out = tmp_path / "int4"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "int4", "--no-gptq", "--no-awq",
                            "--group-size", "channel", "-q"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qconfig["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] == "channel" and weights["group_size"] is None
    assert np.shape(open_quantized(out).qarray("model.layers.0.mlp.down_proj").scale) == (64, 1)


def test_group_size_is_refused_for_other_schemes(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src")
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "int8",
                            "--group-size", "64"], capsys)
    assert code == 2 and "--group-size applies to --scheme int4, int4-asym or w4a8-fp8 only" in err


@pytest.mark.parametrize("magnitude", [4e-4, 2e-5, 1e-6, 3e-8])
def test_float16_groups_with_subnormal_scales_equal_compressed_tensors(magnitude):
    """A float16 group whose absmax / 7.5 is below float16's smallest normal keeps its subnormal scale, as
    compressed-tensors does (the scale was flushed to zero, then float16's eps: every code 0)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 256)) * 0.02).astype(np.float16)
    w[:8] = (rng.standard_normal((8, 256)) * magnitude).astype(np.float16)  # tiny groups, some subnormal
    codes, scale = compressed_tensors_int4(w, 64)
    q = quantize_int4(w, 64)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale)
    np.testing.assert_array_equal(np.asarray(q.qvalue), codes)
    if magnitude >= 2e-5:
        assert np.count_nonzero(np.asarray(q.qvalue)[:8]) > 0.5 * 8 * 256
