"""--scheme int4-asym against compressed-tensors itself: its min-max round-to-nearest with zero points, its
packing of zero points along the output dimension, its W4A16_ASYM config; and the preset names as --scheme."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams

import qconvert.schemes.rowwise as rowwise
from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli
from qconvert.formats.layout_int4_asym import pack_zero_points, unpack_zero_points
from qconvert.formats.layouts import open_quantized
from qconvert.inspection import inspect_checkpoint
from qconvert.schemes import canonical_name, scheme_named
from qconvert.schemes.int4_asym import int4_asym_clip_search, quantize_int4_asym

TORCH_DTYPES = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float16): torch.float16,
                np.dtype(np.float32): torch.float32}


def compressed_tensors_int4_asym(w: np.ndarray, group: int | None):
    """compressed-tensors' own round-to-nearest: min/max observer per group, calculate_qparams, quantize."""
    t = torch.from_numpy(w.astype(np.float32)).to(TORCH_DTYPES[w.dtype])
    if group:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group)
        g = t.reshape(t.shape[0], -1, group)
        low, high = g.amin(dim=2), g.amax(dim=2)
    else:
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="channel")
        low, high = t.amin(dim=1, keepdim=True), t.amax(dim=1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    codes = quantize(t, scale, zero_point, args, dtype=torch.int8)
    return codes, scale, zero_point, args


def awkward_weight(shape, dtype, group):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * 0.02).astype(dtype)
    width = group or shape[1]
    w[0, :width] = 0  # all zero: 0 / 0 zero point, eps scale
    w[1, :width] = np.abs(w[1, :width])  # all positive: low clamps to 0
    w[2, :width] = -np.abs(w[2, :width])  # all negative: high clamps to 0
    w[3, 5] = 1.5  # an outlier
    return w


@pytest.mark.parametrize("shape, dtype, group", [
    ((576, 1536), ml_dtypes.bfloat16, 64),
    ((1536, 576), ml_dtypes.bfloat16, 64),
    ((2048, 2048), ml_dtypes.bfloat16, 128),
    ((576, 1536), np.float16, 32),
    ((576, 1536), np.float32, None),
])
def test_codes_scales_and_zero_points_equal_compressed_tensors_round_to_nearest(shape, dtype, group):
    w = awkward_weight(shape, dtype, group)
    codes, scale, zero_point, _ = compressed_tensors_int4_asym(w, group)
    q = quantize_int4_asym(w, group)
    np.testing.assert_array_equal(np.asarray(q.scale).astype(np.float32), scale.float().numpy())
    np.testing.assert_array_equal(np.asarray(q.zero_point), zero_point.numpy())
    np.testing.assert_array_equal(np.asarray(q.qvalue), codes.numpy())
    assert np.asarray(q.scale).dtype == np.dtype(dtype)
    # The packed zero points are compressed-tensors' own pack_to_int32 along the output dimension.
    np.testing.assert_array_equal(pack_zero_points(np.asarray(q.zero_point)),
                                  pack_to_int32(zero_point, 4, packed_dim=0).numpy())


def test_the_dequantized_weight_is_compressed_tensors_dequantization():
    w = awkward_weight((256, 512), ml_dtypes.bfloat16, 128)
    codes, scale, zero_point, args = compressed_tensors_int4_asym(w, 128)
    theirs = dequantize(codes, scale, zero_point, args).float().numpy()  # (q - z) * s in bf16, as loaders do
    ours = np.asarray(quantize_int4_asym(w, 128).dequantize(ml_dtypes.bfloat16)).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)


def test_streamed_rows_give_the_whole_tensor_quantization(monkeypatch):
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 3_000)  # blocks of a few rows
    w = awkward_weight((37, 256), ml_dtypes.bfloat16, 64)
    scheme = scheme_named("int4-asym")
    flags = scheme.layout_flags(group_size=64, shapes={"m": w.shape})
    streamed = scheme.quantize_rows(lambda a, b: w[a:b], w.shape, w.dtype, flags)
    codes, scale, zero_point, _ = compressed_tensors_int4_asym(w, 64)
    np.testing.assert_array_equal(streamed.qvalue, codes.numpy())
    np.testing.assert_array_equal(np.asarray(streamed.scale).astype(np.float32), scale.float().numpy())
    np.testing.assert_array_equal(streamed.zero_point, zero_point.numpy())


def test_zero_point_packing_hand_worked_case():
    # Column 0 holds rows 0..8 with zero points -8..0: word 0 takes rows 0..7 as nibbles 0..7 (z + 8), word 1
    # takes row 8 (nibble 8) alone.
    zero = np.arange(-8, 1, dtype=np.int8).reshape(9, 1)
    packed = pack_zero_points(zero)
    assert packed.shape == (2, 1)
    assert packed[0, 0] == np.int32(np.uint32(0x76543210).view(np.int32)) and packed[1, 0] == 8
    np.testing.assert_array_equal(unpack_zero_points(packed, 9), zero)


def test_clip_search_never_does_worse_than_the_plain_range():
    w = awkward_weight((64, 256), np.float32, 64)
    result = int4_asym_clip_search(w, 64)
    assert result.error_searched <= result.error_plain
    clipped = quantize_int4_asym(w, 64, clip=result.ratios)
    plain = quantize_int4_asym(w, 64)
    err = lambda q: float(((np.asarray(q.dequantize(np.float32)) - w) ** 2).sum())  # noqa: E731
    assert err(clipped) <= err(plain) * 1.001


def test_the_quantization_config_is_the_compressed_tensors_w4a16_asym_preset(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "w4a16_asym", "--no-gptq", "--no-awq", "-q"], capsys)
    assert code == 0, err
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qconfig["config_groups"]["group_0"]["weights"]
    preset = preset_name_to_scheme("W4A16_ASYM", ["Linear"]).weights
    for key in ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic"):
        assert weights[key] == getattr(preset, key), key
    assert qconfig["format"] == "pack-quantized" and qconfig["config_groups"]["group_0"]["input_activations"] is None
    record = json.loads((out / "qconvert.json").read_text())
    assert record["scheme"] == "int4-asym"  # the preset name given is recorded as the scheme
    folder = open_quantized(out)
    module = folder.quantized_modules[0]
    q = folder.qarray(module)
    assert folder.scheme == "int4-asym" and q.zero_point is not None
    assert np.asarray(q.zero_point).min() >= -8 and np.asarray(q.zero_point).max() <= 7
    folder.close()
    row = next(r for r in inspect_checkpoint(out).tensors if r.name == module)
    assert row.kind == "int4-asym" and row.dtype == "int4 in int32 + zero points"


def test_a_zero_point_tensor_that_does_not_fit_is_one_line_naming_it(tmp_path, capsys):
    from safetensors.numpy import load_file, save_file

    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=256)
    out = tmp_path / "out"
    assert run_cli(["quantize", str(src), "-o", str(out), "--scheme", "int4-asym", "--no-gptq", "--no-awq", "-q"], capsys)[0] == 0
    tensors = load_file(str(out / "model.safetensors"))
    name = next(k for k in tensors if k.endswith(".weight_zero_point"))
    tensors[name] = np.zeros((tensors[name].shape[0] * 8, tensors[name].shape[1]), np.int32)  # left unpacked
    save_file(tensors, str(out / "model.safetensors"))
    code, _, err = run_cli(["inspect", str(out)], capsys)
    assert code == 6 and "weight_zero_point" in err and "does not fit" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("alias, name", [("W4A16", "int4"), ("w4a16_asym", "int4-asym"), ("W8A16", "int8"),
                                         ("W8A8", "w8a8"), ("fp8_dynamic", "fp8"), ("INT4", "int4")])
def test_compressed_tensors_preset_names_are_scheme_aliases(alias, name):
    assert canonical_name(alias) == name and scheme_named(alias).name == name


def test_an_unknown_scheme_names_the_presets_too(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src")
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "W3A16"], capsys)
    assert code == 2 and "W3A16" in err and not (tmp_path / "o").exists()


def test_quantize_help_names_the_preset_aliases(capsys):
    code, out, _ = run_cli(["quantize", "--help"], capsys)
    text = " ".join(out.split())
    from qconvert.schemes import NAMES

    assert code == 0 and f"[{'|'.join(NAMES)}]" in text and "int4-asym" in NAMES  # the choices stay the scheme names
    for alias, name in (("W4A16", "int4"), ("W4A16_ASYM", "int4-asym"), ("W8A16", "int8"), ("W8A8", "w8a8"),
                        ("FP8_DYNAMIC", "fp8"), ("W4AFP8", "w4a8-fp8")):
        assert f"{alias} ({name})" in text


def test_the_compressed_tensors_w4a16_asym_preset_reads_as_int4_asym_with_groups_of_128():
    from compressed_tensors.quantization import QuantizationConfig

    from qconvert.formats.layout_base import LayoutFlags
    from qconvert.formats.layouts import layout_for, layout_for_config

    qconfig = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16_ASYM", ["Linear"])},
                                 format="pack-quantized", quantization_status="compressed").model_dump()
    assert layout_for_config(qconfig) == (layout_for("int4-asym"), LayoutFlags(group_size=128))
    symmetric = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])},
                                   format="pack-quantized", quantization_status="compressed").model_dump()
    assert layout_for_config(symmetric)[0] == layout_for("int4")


def test_group_sizes_fall_back_and_are_refused_as_int4s(tmp_path, capsys):
    src = make_llama_checkpoint(tmp_path / "src", hidden=128, intermediate=192)
    out = tmp_path / "out"
    code, _, err = run_cli(["quantize", str(src), "-o", str(out), "--scheme", "int4-asym", "--no-gptq", "--no-awq"], capsys)
    assert code == 0, err
    assert "qconvert: int4-asym: group size 64 (128 does not divide every input width)" in err
    assert json.loads((out / "qconvert.json").read_text())["flags"]["group_size"] == 64
    folder = open_quantized(out)
    q = folder.qarray("model.layers.0.mlp.down_proj")
    assert q.block_size == 64 and np.shape(q.zero_point) == (128, 3)
    folder.close()
    code, _, err = run_cli(["quantize", str(src), "-o", str(tmp_path / "o"), "--scheme", "int4-asym", "--no-gptq", "--no-awq",
                            "--group-size", "128"], capsys)
    assert code == 2 and not (tmp_path / "o").exists()
    assert err.strip().splitlines()[-1] == ("qconvert: error: --group-size 128 does not divide "
                                            "model.layers.0.mlp.down_proj's input width 192; use 64 or 32 or channel")
