"""FP8-shipped checkpoints (DeepSeek-style block FP8, compressed-tensors float-quantized) read as float sources:
the dequantization against hand-decoded bytes, compressed-tensors and transformers; a conversion of one equals,
byte for byte, the conversion of its dequantized bfloat16 copy; what stays refused."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import run
from compile_cache import compiled_once  # noqa: F401 - autouse: this module's conversions compile once
from fp8_checkpoints import (
    as_torch, bfloat16_bits, dequantized_by_hand, e8m0_values, quantize_blocks, write_dequantized_copy,
    write_fp8_source,
)
from hf_checkpoints import make_hf_checkpoint
from qconvert.formats import dequantized_checkpoint
from qconvert.formats.dequantized_checkpoint import DequantizedCheckpoint
from qconvert.formats.quantized_sources import source_format
from qconvert.formats.safetensors_io import open_checkpoint

CALIB = ["--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16"]


DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _open(folder, qconfig) -> DequantizedCheckpoint:
    return DequantizedCheckpoint(open_checkpoint(folder), source_format(qconfig))


def _bits(array) -> np.ndarray:
    assert array.dtype == ml_dtypes.bfloat16
    return np.asarray(array).view(np.uint16)


@pytest.mark.parametrize("scale_dtype, ue8m0", [("float32", False), ("bfloat16", False), ("float32", True),
                                                ("float8_e8m0fnu", True)])
def test_block_fp8_weights_read_as_their_bytes_say_edge_blocks_partial(tmp_path, monkeypatch, scale_dtype, ue8m0):
    # [300, 200] in blocks of 128: rows 128 + 128 + 44, columns 128 + 72.
    weight = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32) * 0.02
    codes, scale = quantize_blocks(weight, (128, 128), power_of_two=ue8m0,
                                   scale_dtype=ml_dtypes.bfloat16 if scale_dtype == "bfloat16" else np.float32)
    if scale_dtype == "float8_e8m0fnu":
        raw = (np.log2(scale) + 127).astype(np.uint8)
        stored_scale, scale_values = as_torch(raw, torch.float8_e8m0fnu), e8m0_values(raw)
    else:
        stored_scale = as_torch(scale, getattr(torch, scale_dtype))
        scale_values = scale.astype(np.float64)
    norm = np.linspace(0.5, 1.5, 200).astype(ml_dtypes.bfloat16)
    save_file({"m.proj.weight": as_torch(codes, torch.float8_e4m3fn), "m.proj.weight_scale_inv": stored_scale,
               "m.norm.weight": as_torch(norm, torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(dequantized_checkpoint, "CHUNK_ELEMENTS", 7 * 200)  # 7 rows a chunk: chunks cross blocks
    expected = dequantized_by_hand(codes, scale_values, (128, 128))
    qconfig = {**DEEPSEEK, **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    with _open(tmp_path, qconfig) as view:
        assert view.tensor_names == ["m.norm.weight", "m.proj.weight"] and "m.proj.weight_scale_inv" not in view
        assert view.dtype("m.proj.weight") == ml_dtypes.bfloat16 and view.shape("m.proj.weight") == (300, 200)
        assert view.nbytes("m.proj.weight") == 300 * 200 * 2
        np.testing.assert_array_equal(_bits(view.get("m.proj.weight")), expected)
        np.testing.assert_array_equal(_bits(view.get_rows("m.proj.weight", 100, 262)), expected[100:262])
        np.testing.assert_array_equal(_bits(view.get("m.norm.weight")), norm.view(np.uint16))  # as stored


def test_a_ue8m0_config_with_scales_that_are_not_powers_of_two_is_refused(tmp_path):
    codes, scale = quantize_blocks(np.ones((4, 4), np.float32) * 3.0, (128, 128))  # 3/448: no power of two
    save_file({"m.proj.weight": as_torch(codes, torch.float8_e4m3fn),
               "m.proj.weight_scale_inv": as_torch(scale, torch.float32)},
              str(tmp_path / "model.safetensors"))
    from qconvert.formats.errors import InvalidCheckpointError

    with _open(tmp_path, {**DEEPSEEK, "scale_fmt": "ue8m0"}) as view, \
            pytest.raises(InvalidCheckpointError, match="not powers of two"):
        view.get("m.proj.weight")


@pytest.mark.parametrize("strategy, scale_shape, scale_dtype", [
    ("channel", (200, 1), torch.bfloat16), ("tensor", (1,), torch.float32), ("block", (2, 3), torch.bfloat16),
    ("block", (2, 3), torch.float32)])
def test_compressed_tensors_float_quantized_reads_as_compressed_tensors_decompresses(tmp_path, strategy, scale_shape,
                                                                                      scale_dtype):
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme

    rng = np.random.default_rng(1)
    codes = as_torch(rng.integers(0, 256, (200, 300), dtype=np.uint8) & 0b1011_1111, torch.float8_e4m3fn)  # no NaN
    scale = torch.from_numpy(rng.uniform(1e-3, 2e-3, scale_shape).astype(np.float32)).to(scale_dtype)
    save_file({"m.proj.weight": codes, "m.proj.weight_scale": scale}, str(tmp_path / "model.safetensors"))
    preset = {"channel": "FP8_DYNAMIC", "tensor": "FP8", "block": "FP8_BLOCK"}[strategy]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                 quantization_status="compressed").model_dump()
    theirs = FloatQuantizationCompressor.decompress({"weight": codes, "weight_scale": scale},
                                                    QuantizationScheme.model_validate(scheme.model_dump()))["weight"]
    with _open(tmp_path, qconfig) as view:
        ours = view.get("m.proj.weight")
        assert view.tensor_names == ["m.proj.weight"]
    # compressed-tensors multiplies in the scale's dtype: bfloat16 as ours, float32 rounded once to bfloat16 here.
    np.testing.assert_array_equal(_bits(ours), bfloat16_bits(theirs.float().numpy()))


@pytest.fixture(scope="module")
def qwen3_sources(tmp_path_factory):
    """A tiny bf16 Qwen3 (hidden 200, intermediate 160: partial 128-blocks), its DeepSeek-style FP8 form and that
    form's dequantized copy, the two under the same folder name."""
    root = tmp_path_factory.mktemp("qwen3")
    bf16 = make_hf_checkpoint(root / "bf16", "qwen3", hidden=200, intermediate=160, layers=1, dtype="bfloat16")
    fp8 = write_fp8_source(bf16, root / "fp8" / "model")
    return fp8, write_dequantized_copy(fp8, root / "copy" / "model")


@pytest.fixture(scope="module")
def deepseek_sources(tmp_path_factory):
    """A tiny bf16 DeepSeek-V3 (MLA, dense layer 0, routed and shared experts), written in its own release's
    block-FP8 form, and that form's dequantized copy."""
    root = tmp_path_factory.mktemp("deepseek")
    bf16 = make_hf_checkpoint(root / "bf16", "deepseek_v3", layers=2, dtype="bfloat16")
    fp8 = write_fp8_source(bf16, root / "fp8" / "model")
    return fp8, write_dequantized_copy(fp8, root / "copy" / "model")


@pytest.mark.parametrize("args", [["--scheme", "int4", "--gptq", *CALIB], ["--scheme", "w8a8", *CALIB]],
                         ids=["int4-gptq", "w8a8"])
def test_deepseek_v3_in_its_block_fp8_release_form_converts_as_its_dequantized_copy(deepseek_sources, tmp_path,
                                                                                     capsys, args):
    fp8, copy = deepseek_sources
    with _open(fp8, DEEPSEEK) as view:  # every linear of its layers read from fp8: MLA's, the experts', shared
        assert any(name.endswith("kv_a_proj_with_mqa.weight") for name in view.quantized_weights)
        assert any(".mlp.experts." in name for name in view.quantized_weights)
    record = _converted_equal(fp8, copy, tmp_path, args, capsys)
    assert record["source"]["format"] == "fp8-block-128x128"


def test_transformers_dequantizes_a_block_fp8_folder_as_qconvert_reads_it(tmp_path):
    import transformers

    # Whole 128-blocks (hidden 256, intermediate 384): transformers 5.24's load-time dequantization takes the block
    # as rows // scale rows, which is not the format's 128 where an edge block is partial ([200, 160] -> 100 x 80).
    bf16 = make_hf_checkpoint(tmp_path / "bf16", "qwen3", hidden=256, intermediate=384, layers=1, dtype="bfloat16")
    fp8 = write_fp8_source(bf16, tmp_path / "fp8")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(fp8), quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16)
    theirs = {name: p.detach() for name, p in model.named_parameters()}
    with _open(fp8, DEEPSEEK) as view:
        assert len(view.quantized_weights) == 7
        for name in view.quantized_weights:
            np.testing.assert_array_equal(_bits(view.get(name)), theirs[name].view(torch.int16).numpy().view(np.uint16))


def _converted_equal(fp8, copy, out, args, capsys) -> dict:
    """Convert both sources with `args`; assert every file but qconvert.json and the card is byte-identical, and
    qconvert.json differs only in its source; returns the FP8 conversion's qconvert.json."""
    for src, name in ((fp8, "from-fp8"), (copy, "from-copy")):
        code, _, err = run(["quantize", str(src), "-o", str(out / name), "-q", *args], capsys)
        assert code == 0, err
    names = sorted(p.name for p in (out / "from-fp8").iterdir())
    assert names == sorted(p.name for p in (out / "from-copy").iterdir())
    for name in names:
        if name not in ("qconvert.json", "README.md"):
            assert (out / "from-fp8" / name).read_bytes() == (out / "from-copy" / name).read_bytes(), name
    records = [json.loads((out / n / "qconvert.json").read_text()) for n in ("from-fp8", "from-copy")]
    for record in records:
        del record["source"], record["files"]["README.md"]
    assert records[0] == records[1]
    return json.loads((out / "from-fp8" / "qconvert.json").read_text())


@pytest.mark.parametrize("args", [["--scheme", "int4", "--gptq", *CALIB], ["--scheme", "w8a8", *CALIB]],
                         ids=["int4-gptq", "w8a8"])
def test_a_block_fp8_source_converts_as_its_dequantized_copy(qwen3_sources, tmp_path, capsys, args):
    fp8, copy = qwen3_sources
    record = _converted_equal(fp8, copy, tmp_path, args, capsys)
    assert record["source"]["format"] == "fp8-block-128x128"
    assert record["source"]["folder_from_out"].endswith("/fp8/model")
    assert record["rounding"]["method"] == ("gptq" if "int4" in args else "rtn")
    config = json.loads((tmp_path / "from-fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"  # qconvert's own, not the source's


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_compressed_tensors_fp8_block_source_converts_as_its_dequantized_copy(family, tmp_path, capsys):
    bf16 = make_hf_checkpoint(tmp_path / "bf16", family, hidden=200, intermediate=160, layers=1, dtype="bfloat16",
                              **({"moe_intermediate_size": 136} if family == "qwen3_moe" else {}))
    fp8 = write_fp8_source(bf16, tmp_path / "fp8" / "model", style="compressed-tensors", scale_dtype="bfloat16")
    copy = write_dequantized_copy(fp8, tmp_path / "copy" / "model", style="compressed-tensors")
    with _open(fp8, json.loads((fp8 / "config.json").read_text())["quantization_config"]) as view:
        assert len(view.quantized_weights) == (4 + 3 * 4 if family == "qwen3_moe" else 7)  # every expert's too
    # GPTQ calibrates through every layer (experts and router included) and rounds each expert on its own
    # Hessian; w8a8 on the dense model adds SmoothQuant (Qwen3-MoE's w8a8 reads its weights the same way).
    schemes = [["--scheme", "int4", "--gptq", *CALIB]] + ([["--scheme", "w8a8", *CALIB]] if family == "qwen3" else [])
    for scheme_args in schemes:
        out = tmp_path / scheme_args[1]
        record = _converted_equal(fp8, copy, out, scheme_args, capsys)
        assert record["source"]["format"] == "compressed-tensors-fp8-block-128x128"


def test_verify_and_inspect_read_the_fp8_source(qwen3_sources, tmp_path, capsys):
    fp8, _ = qwen3_sources
    out = tmp_path / "out"
    assert run(["quantize", str(fp8), "-o", str(out), "-q", "--scheme", "w8a8", *CALIB], capsys)[0] == 0
    code, stdout, err = run(["verify", str(out), "--quick", "--json", "--backend", "xla"], capsys)
    report = json.loads(stdout)
    assert code == 0, err
    assert report["reference"]["format"] == "fp8-block-128x128" and report["passed"] is True
    code, stdout, _ = run(["inspect", str(out)], capsys)
    assert code == 0 and "(fp8-block-128x128: its fp8 weights read as bfloat16)" in " ".join(stdout.split())
    code, stdout, _ = run(["inspect", str(out), "--json"], capsys)
    assert json.loads(stdout)["source"]["format"] == "fp8-block-128x128"
    assert "(fp8-block-128x128: its fp8 weights read as bfloat16)" in (out / "README.md").read_text()


@pytest.mark.parametrize("qconfig, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}},
     "quant_method 'compressed-tensors', format 'marlin-24'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "quant_method 'fp8' without weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {}},
     "quant_method 'compressed-tensors', format 'naive-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}},
     "quant_method 'compressed-tensors', format 'int-quantized'"),
])
def test_other_quantized_sources_are_refused_with_one_line(qwen3_sources, tmp_path, capsys, qconfig, named):
    _, copy = qwen3_sources
    source = tmp_path / "model"
    shutil.copytree(copy, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    code, _, err = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    (line,) = err.strip().splitlines()
    assert code == 5 and f"is already quantized (its config.json has a quantization_config, {named}" in line
    assert "block FP8" in line and "compressed-tensors float-quantized FP8" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda t, c: t.pop("model.layers.0.mlp.down_proj.weight_scale_inv"), "weight_scale_inv is missing"),
    (lambda t, c: t.update({"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)}),
     "has shape [1, 1], but a fp8-block-128x128 scale of a [200, 160] weight is [2, 2]"),
    (lambda t, c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size is [128]"),
])
def test_a_broken_block_fp8_source_is_one_line_and_exit_6(qwen3_sources, tmp_path, capsys, edit, words):
    from safetensors.torch import load_file

    fp8, _ = qwen3_sources
    source = tmp_path / "model"
    shutil.copytree(fp8, source)
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(source / "model.safetensors"))
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run(["quantize", str(source), "-o", str(tmp_path / "out")], capsys)
    (line,) = err.strip().splitlines()
    assert code == 6 and words in line, line
    assert not (tmp_path / "out").exists()
