"""4-bit-shipped checkpoints read as float sources: compressed-tensors pack-quantized int4 (symmetric and with zero
points, as qconvert writes it and as compressed-tensors' own compressor writes it), nvfp4- and mxfp4-pack-quantized
and gpt-oss's MXFP4. Each reads as the peer library's own decompression says (compressed-tensors' decompressors,
transformers' MXFP4 dequantization); a conversion of one equals, byte for byte, the conversion of that
decompressed copy; broken ones are one line and exit 6."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_helpers import run
from compile_cache import compiled_once  # noqa: F401 - autouse: this module's conversions compile once
from gpt_oss_checkpoints import quantize_mxfp4
from hf_checkpoints import make_hf_checkpoint
from qconvert.formats import dequantized_checkpoint
from qconvert.formats.dequantized_checkpoint import DequantizedCheckpoint
from qconvert.formats.quantized_sources import dequantized_dtype, source_format
from qconvert.formats.safetensors_io import open_checkpoint

CALIB = ["--calib", "random", "--calib-samples", "2", "--calib-seqlen", "16"]
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def _open(folder) -> DequantizedCheckpoint:
    config = _config(folder)
    fmt = source_format(config["quantization_config"])
    return DequantizedCheckpoint(open_checkpoint(folder), fmt, dequantized_dtype(fmt, config))


def _scheme(qconfig: dict):
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = qconfig["config_groups"].values()
    return QuantizationScheme.model_validate({k: group.get(k) for k in ("targets", "weights", "input_activations",
                                                                       "output_activations")})


def decompressed(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a compressed-tensors folder as its float model has it: each quantized module's parts
    through compressed-tensors' own decompressor for the config's format, rounded to config.json's dtype."""
    from compressed_tensors.compressors import BaseCompressor

    config = _config(folder)
    qconfig = config["quantization_config"]
    compressor, scheme = BaseCompressor.get_value_from_registry(qconfig["format"]), _scheme(qconfig)
    dtype = TORCH_DTYPES[config.get("torch_dtype", config.get("dtype"))]
    stored = load_file(str(Path(folder) / "model.safetensors"))
    modules = {name[: -len(".weight_packed")] for name in stored if name.endswith(".weight_packed")}
    tensors = {name: t for name, t in stored.items() if name.rsplit(".", 1)[0] not in modules}
    for module in modules:
        parts = {name[len(module) + 1:]: t for name, t in stored.items() if name.rsplit(".", 1)[0] == module}
        tensors[module + ".weight"] = compressor.decompress(parts, scheme)["weight"].to(dtype)
    return tensors


def _write_folder(src: Path, dst: Path, config: dict, tensors: dict) -> Path:
    """`tensors` and `config` in a new folder `dst`, with every other file of `src` copied."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_decompressed_copy(folder, dst) -> Path:
    """The float checkpoint a compressed-tensors folder stands for (decompressed()), its config without the
    quantization_config."""
    config = {k: v for k, v in _config(folder).items() if k != "quantization_config"}
    return _write_folder(Path(folder), Path(dst), config, decompressed(folder))


def _bits(array) -> np.ndarray:
    array = np.asarray(array)
    return array.view({2: np.uint16, 4: np.uint32}[array.dtype.itemsize])


def _torch_bits(tensor) -> np.ndarray:
    return _bits(tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()]).numpy())


def write_compressor_source(bf16_folder, dst, *, group_size: int | None, symmetric: bool, dtype: str) -> Path:
    """`bf16_folder`'s decoder linears quantized to int4 and packed by compressed-tensors' own
    PackedQuantizationCompressor (scales from its min-max observer's rule, computed here), in `dtype`."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    src, dst = Path(bf16_folder), Path(dst)
    strategy = "group" if group_size else "channel"
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group_size}
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                 quantization_status="compressed", ignore=["lm_head"]).model_dump()
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        tensor = tensor.to(TORCH_DTYPES[dtype])
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = tensor
            continue
        rows = tensor.reshape(tensor.shape[0], -1, group_size or tensor.shape[1])
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), scheme.weights)
        parts = {"weight": tensor, "weight_scale": scale.to(tensor.dtype), "weight_zero_point": zero}
        for key, value in PackedQuantizationCompressor.compress(parts, scheme).items():
            tensors[name[: -len("weight")] + key] = value
    config = {**{k: v for k, v in _config(src).items() if k != "torch_dtype"}, "dtype": dtype,
              "quantization_config": qconfig}
    return _write_folder(src, dst, config, tensors)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny bf16 Qwen3 and its 4-bit forms: qconvert's int4 and int4-asym (groups of 32), nvfp4a16 and mxfp4a16, and
    compressed-tensors' own compressor's int4 (asymmetric, groups of 64, bfloat16; symmetric per channel,
    float16), each under <root>/<form>/model beside its decompressed copy under <root>/<form>-copy/model."""
    from qconvert.cli.main import main

    root = tmp_path_factory.mktemp("4bit")
    bf16 = make_hf_checkpoint(root / "bf16", "qwen3", hidden=128, intermediate=192, layers=1, dtype="bfloat16",
                              head_dim=32)
    forms = {}
    for form, args in (("int4", ["--scheme", "int4", "--group-size", "32", "--no-gptq", "--no-awq"]),
                       ("int4-asym", ["--scheme", "int4-asym", "--group-size", "32", "--no-gptq", "--no-awq"]),
                       ("nvfp4a16", ["--scheme", "nvfp4a16", "--no-gptq", "--no-awq"]),
                       ("mxfp4a16", ["--scheme", "mxfp4a16", "--no-gptq", "--no-awq"])):
        with pytest.raises(SystemExit) as done:
            main(["quantize", str(bf16), "-o", str(root / form / "model"), "-q", *args])
        assert done.value.code == 0
        forms[form] = root / form / "model"
    forms["ct-asym-g64"] = write_compressor_source(bf16, root / "ct-asym-g64" / "model", group_size=64,
                                                   symmetric=False, dtype="bfloat16")
    forms["ct-channel-fp16"] = write_compressor_source(bf16, root / "ct-channel-fp16" / "model", group_size=None,
                                                       symmetric=True, dtype="float16")
    return {form: (folder, write_decompressed_copy(folder, root / f"{form}-copy" / "model"))
            for form, folder in forms.items()}


@pytest.mark.parametrize("form, name, dtype", [
    ("int4", "compressed-tensors-int4-group-32", ml_dtypes.bfloat16),
    ("int4-asym", "compressed-tensors-int4-asym-group-32", ml_dtypes.bfloat16),
    ("nvfp4a16", "compressed-tensors-nvfp4", ml_dtypes.bfloat16),
    ("mxfp4a16", "compressed-tensors-mxfp4", ml_dtypes.bfloat16),
    ("ct-asym-g64", "compressed-tensors-int4-asym-group-64", ml_dtypes.bfloat16),
    ("ct-channel-fp16", "compressed-tensors-int4-channel", np.float16)])
def test_each_4bit_form_reads_as_compressed_tensors_decompresses_it(sources, monkeypatch, form, name, dtype):
    folder, _ = sources[form]
    monkeypatch.setattr(dequantized_checkpoint, "CHUNK_ELEMENTS", 5 * 192)  # chunks of 5 rows: not 8-aligned
    theirs = decompressed(folder)
    with _open(folder) as view:
        assert view.source_format.name == name
        assert len(view.quantized_weights) == 7 and sorted(view.tensor_names) == sorted(theirs)
        assert not any(n.endswith(("_packed", "_scale", "_shape", "_zero_point")) for n in view.tensor_names)
        for weight in view.quantized_weights:
            assert view.dtype(weight) == dtype and view.shape(weight) == tuple(theirs[weight].shape)
            np.testing.assert_array_equal(_bits(view.get(weight)), _torch_bits(theirs[weight]), err_msg=weight)
            np.testing.assert_array_equal(_bits(view.get_rows(weight, 3, 61)), _torch_bits(theirs[weight][3:61]))


def _converted_equal(source, copy, out, args, capsys) -> dict:
    """Convert both with `args`; every file but qconvert.json and the card byte-identical, qconvert.json differing
    only in its source; returns the 4-bit source's conversion record."""
    for src, name in ((source, "from-4bit"), (copy, "from-copy")):
        code, _, err = run(["quantize", str(src), "-o", str(out / name), "-q", *args], capsys)
        assert code == 0, err
    names = sorted(p.name for p in (out / "from-4bit").iterdir())
    assert names == sorted(p.name for p in (out / "from-copy").iterdir())
    for name in names:
        if name not in ("qconvert.json", "README.md"):
            assert (out / "from-4bit" / name).read_bytes() == (out / "from-copy" / name).read_bytes(), name
    records = [json.loads((out / n / "qconvert.json").read_text()) for n in ("from-4bit", "from-copy")]
    for record in records:
        del record["source"], record["files"]["README.md"]
    assert records[0] == records[1]
    return json.loads((out / "from-4bit" / "qconvert.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("form, args", [
    ("int4", ["--scheme", "int4", "--gptq", *CALIB]),
    ("int4-asym", ["--scheme", "int8"]),
    ("nvfp4a16", ["--scheme", "w8a8", *CALIB]),
    ("mxfp4a16", ["--scheme", "int8"]),
    ("ct-asym-g64", ["--scheme", "int8"]),
    ("ct-channel-fp16", ["--scheme", "int4", "--gptq", *CALIB]),
], ids=["int4-gptq", "asym-int8", "nvfp4-w8a8", "mxfp4-int8", "ct-asym-int8", "ct-fp16-gptq"])
def test_a_4bit_source_converts_as_its_decompressed_copy(sources, tmp_path, capsys, form, args):
    source, copy = sources[form]
    record = _converted_equal(source, copy, tmp_path, args, capsys)
    assert record["source"]["format"] == source_format(_config(source)["quantization_config"]).name


def _mxfp4_folder(folder: Path, blocks: np.ndarray, scales: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = "model.layers.0.mlp.experts.gate_up_proj"
    save_file({base + "_blocks": torch.from_numpy(blocks), base + "_scales": torch.from_numpy(scales),
               base + "_bias": torch.zeros(blocks.shape[0], blocks.shape[1], dtype=torch.bfloat16)},
              str(folder / "model.safetensors"))
    return folder


def test_gpt_oss_mxfp4_reads_as_transformers_dequantizes_it(tmp_path, monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # 3 experts, [40 out, 128 in]
    scales = rng.integers(100, 140, (3, 40, 4), dtype=np.uint8)
    folder = _mxfp4_folder(tmp_path / "model", blocks, scales)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    monkeypatch.setattr(dequantized_checkpoint, "CHUNK_ELEMENTS", 2 * 128 * 40)  # two experts a chunk
    fmt = source_format({"quant_method": "mxfp4"})
    with DequantizedCheckpoint(open_checkpoint(folder), fmt, np.dtype(ml_dtypes.bfloat16)) as view:
        name = "model.layers.0.mlp.experts.gate_up_proj"
        assert view.tensor_names == [name, name + "_bias"] and view.shape(name) == (3, 128, 40)
        np.testing.assert_array_equal(_bits(view.get(name)), _torch_bits(theirs))
        np.testing.assert_array_equal(_bits(view.get_rows(name, 1, 3)), _torch_bits(theirs[1:3]))


def test_the_test_mxfp4_writer_round_trips_through_transformers():
    """The helper that writes the gpt-oss MXFP4 fixtures: transformers dequantizes its bytes back to within two
    group scales of the float experts (the widest E2M1 gap, 4 to 6, is two; the OCP rule clips up to 8 to 6), and
    the nearest E2M1 value on average (a wrong nibble order or transposition would be far from both)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = np.random.default_rng(4).standard_normal((2, 64, 96)).astype(np.float32)  # [experts, in, out]
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2)
    back = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    step = np.repeat(2.0 ** (scales.astype(np.float64) - 127), 32, axis=-1).transpose(0, 2, 1)
    error = np.abs(back.numpy() - weight) / step
    assert error.max() <= 2 and error.mean() < 0.25
    swapped = (blocks >> 4) | (blocks << 4)  # the nibble order the other way round: far off
    back = convert_moe_packed_tensors(torch.from_numpy(swapped), torch.from_numpy(scales), dtype=torch.float32)
    assert (np.abs(back.numpy() - weight) / step).mean() > 1


DOWN = "model.layers.0.mlp.down_proj"


def _edit_scale_nan(t, c, s):
    t[DOWN + ".weight_scale"] = t[DOWN + ".weight_scale"].clone()
    t[DOWN + ".weight_scale"][1, 2] = float("nan")


@pytest.mark.parametrize("form, edit, words", [
    ("int4", lambda t, c, s: t.pop(DOWN + ".weight_scale"), f"{DOWN}.weight_scale is missing"),
    ("int4", lambda t, c, s: t.update({DOWN + ".weight_scale": torch.ones(128, 3, dtype=torch.bfloat16)}),
     "has shape [128, 3], but a compressed-tensors-int4-group-32 scale of a [128, 192] weight is [128, 6]"),
    ("int4", _edit_scale_nan, "holds scales that are not finite (NaN), so the int4 weight they scale cannot be read"),
    ("int4", lambda t, c, s: t.update({DOWN + ".weight_shape": torch.tensor([128, 200])}),
     "the packing does not match the shape"),
    ("int4-asym", lambda t, c, s: t.pop(DOWN + ".weight_zero_point"), "weight_zero_point is missing"),
    ("int4", lambda t, c, s: t.update({DOWN + ".weight_zero_point": torch.zeros(16, 6, dtype=torch.int32)}),
     "weight_zero_point is stored, but config.json's quantization_config says"),
    ("nvfp4a16", lambda t, c, s: t.update({DOWN + ".weight_global_scale": torch.tensor([float("inf")])}),
     "weight_global_scale holds scales that are not finite (infinite)"),
    ("nvfp4a16", lambda t, c, s: t.update({DOWN + ".weight_scale": t[DOWN + ".weight_scale"][:, :5].contiguous()}),
     "float8_e4m3fn [128, 5], but the scales of a [128, 192] compressed-tensors-nvfp4 weight are float8_e4m3fn "
     "[128, 12]"),
    ("int4", lambda t, c, s: c.update(quantization_config=_config(s["nvfp4a16"][0])["quantization_config"]),
     "not uint8 [out, in/2] (two E2M1 codes a byte); the packing does not match the format"),
    ("mxfp4a16", lambda t, c, s: t.update({DOWN + ".weight_scale": torch.full((128, 6), 255, dtype=torch.uint8)}),
     "holds scales that are not finite (NaN: E8M0 byte 255)"),
    ("int4", lambda t, c, s: t.update({DOWN + ".weight_g_idx": torch.zeros(192, dtype=torch.int32)}),
     "weight_g_idx orders the weight's columns by activation groups (actorder 'group'), which config.json's"),
])
def test_a_broken_4bit_source_is_one_line_and_exit_6(sources, tmp_path, capsys, form, edit, words):
    folder, _ = sources[form]
    source = tmp_path / "model"
    shutil.copytree(folder, source)
    tensors = load_file(str(source / "model.safetensors"))
    config = _config(source)
    edit(tensors, config, sources)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "int8"], capsys)
    (line,) = err.strip().splitlines()
    assert code == 6 and words in line, line
    assert not (tmp_path / "out").exists()


def test_a_config_claiming_a_4bit_format_over_float_weights_is_refused(sources, tmp_path, capsys):
    _, copy = sources["int4"]
    source = tmp_path / "model"
    shutil.copytree(copy, source)
    config = {**_config(copy), "quantization_config": _config(sources["int4"][0])["quantization_config"]}
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "int8"], capsys)
    (line,) = err.strip().splitlines()
    assert code == 6 and ("quantization_config says compressed-tensors-int4-group-32, but no tensor is stored in "
                          "that format") in line, line


@pytest.mark.parametrize("scales, words", [
    (lambda s: np.where(np.arange(s.size).reshape(s.shape) == 5, 0xFF, s).astype(np.uint8),
     "holds scales that are not finite (NaN: E8M0 byte 255)"),
    (lambda s: s[:, :, :3].copy(), "but the E8M0 scales of model.layers.0.mlp.experts.gate_up_proj_blocks"),
])
def test_a_broken_mxfp4_source_is_refused(tmp_path, scales, words):
    from qconvert.formats.errors import FormatError, InvalidCheckpointError

    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (2, 8, 4, 16), dtype=np.uint8)
    folder = _mxfp4_folder(tmp_path / "model", blocks, scales(rng.integers(120, 130, (2, 8, 4), dtype=np.uint8)))
    with pytest.raises((FormatError, InvalidCheckpointError), match=words.replace("(", r"\(").replace(")", r"\)")):
        with DequantizedCheckpoint(open_checkpoint(folder), source_format({"quant_method": "mxfp4"})) as view:
            view.get("model.layers.0.mlp.experts.gate_up_proj")


def test_inspect_and_the_card_name_the_4bit_source(sources, tmp_path, capsys):
    source, _ = sources["int4-asym"]
    out = tmp_path / "out"
    assert run(["quantize", str(source), "-o", str(out), "-q", "--scheme", "int8"], capsys)[0] == 0
    said = "(compressed-tensors-int4-asym-group-32: its 4-bit weights read as float, in its own dtype)"
    code, stdout, _ = run(["inspect", str(out)], capsys)
    assert code == 0 and said in " ".join(stdout.split())
    assert said in (out / "README.md").read_text()


def test_a_4bit_source_whose_dtype_is_not_a_float_one_is_refused(sources, tmp_path, capsys):
    folder, _ = sources["int4"]
    source = tmp_path / "model"
    shutil.copytree(folder, source)
    (source / "config.json").write_text(json.dumps({**_config(folder), "dtype": "int8"}))
    code, _, err = run(["quantize", str(source), "-o", str(tmp_path / "out"), "--scheme", "int8"], capsys)
    (line,) = err.strip().splitlines()
    assert code == 6 and "config.json: dtype is 'int8'; a compressed-tensors-int4-group-32 checkpoint is read as" \
        in line, line
