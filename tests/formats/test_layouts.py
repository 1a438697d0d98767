"""Export layouts: exact tensor names/dtypes/shapes and configs, QArray round trips, and the peer libraries as judges."""

import json

import bitsandbytes.functional as bnb_functional
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from safetensors.torch import load_file as torch_load_file

from qconvert.formats.errors import FormatError
from qconvert.formats.layouts import (
    layout_for_config,
    linear_tensor_specs,
    open_quantized,
    qarray_to_tensors,
    quantization_config,
)
from qconvert.formats.qarray import NF4_LEVELS, QArray
from qconvert.formats.safetensors_io import TensorSpec, write_shards

MODULE = "model.layers.0.mlp.up_proj"


def int8_qarray(out_features, in_features, scale_dtype=ml_dtypes.bfloat16, seed=0) -> QArray:
    rng = np.random.default_rng(seed)
    return QArray(
        qvalue=rng.integers(-127, 128, (out_features, in_features)).astype(np.int8),
        scale=rng.uniform(0.001, 0.02, (out_features, 1)).astype(scale_dtype),
        kind="int8", shape=(out_features, in_features), dtype=np.dtype(scale_dtype).name,
    )


def nf4_codes_and_qarray(out_features, in_features, dtype="bfloat16", seed=0):
    rng = np.random.default_rng(seed)
    n = out_features * in_features
    codes = rng.integers(0, 16, n).astype(np.uint8)
    padded = np.append(codes, np.uint8(0)) if n % 2 else codes
    packed = ((padded[0::2] << 4) | padded[1::2]).astype(np.uint8)
    absmax = rng.uniform(0.5, 2.0, -(-n // 64)).astype(np.float32)
    q = QArray(qvalue=packed, scale=absmax, kind="nf4", block_size=64, shape=(out_features, in_features), dtype=dtype)
    return codes, q


def independent_pack_int8(q: np.ndarray) -> np.ndarray:
    rows, cols = q.shape
    words = -(-cols // 4)
    unsigned = np.zeros((rows, words * 4), dtype=np.int64)
    unsigned[:, :cols] = q.astype(np.int64) + 128
    groups = unsigned.reshape(rows, words, 4)
    value = sum(groups[:, :, j] << (8 * j) for j in range(4))
    return np.where(value >= 2**31, value - 2**32, value).astype(np.int32)


def write_folder(folder, scheme, items, *, act="dynamic", double_quant=False, extra=None):
    """Write quantized linears ({module: (QArray, input_scale)}) plus float tensors, and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    specs, tensors = [], {}
    for module, (q, input_scale) in items.items():
        float_dtype = q.scale.dtype if q.kind == "int8" else np.dtype(q.dtype)
        specs += linear_tensor_specs(module, scheme, q.shape, float_dtype,
                                     static_act=input_scale is not None, double_quant=double_quant)
        tensors.update(qarray_to_tensors(module, q, scheme, input_scale=input_scale, double_quant=double_quant))
    for name, array in (extra or {}).items():
        specs.append(TensorSpec(name, array.dtype, array.shape))
        tensors[name] = array
    assert [s.name for s in specs] == list(tensors)
    write_shards(folder, specs, ((s.name, tensors[s.name]) for s in specs), max_shard_size=1 << 30)
    config = {"architectures": ["Test"], "quantization_config": quantization_config(scheme, act=act,
                                                                                     double_quant=double_quant)}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "scheme, static, double_quant, shape",
    [("int8", False, False, (6, 10)), ("int8", False, False, (3, 8)), ("w8a8", False, False, (6, 10)),
     ("w8a8", True, False, (6, 10)), ("nf4", False, False, (5, 13)), ("nf4", False, True, (160, 129))],
)
def test_tensors_match_their_specs_in_name_dtype_shape_and_order(scheme, static, double_quant, shape):
    if scheme == "nf4":
        q = nf4_codes_and_qarray(*shape)[1]
        float_dtype = ml_dtypes.bfloat16
    else:
        q = int8_qarray(*shape)
        float_dtype = q.scale.dtype
    specs = linear_tensor_specs(MODULE, scheme, shape, float_dtype, static_act=static, double_quant=double_quant)
    tensors = qarray_to_tensors(MODULE, q, scheme, input_scale=0.5 if static else None, double_quant=double_quant)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [(k, v.dtype, v.shape) for k, v in tensors.items()]


def test_int8_layout_names_dtypes_and_shapes_are_as_documented():
    specs = linear_tensor_specs(MODULE, "int8", (6, 10), ml_dtypes.bfloat16)
    assert [(s.name[len(MODULE):], s.dtype.name, s.shape) for s in specs] == [
        (".weight_packed", "int32", (6, 3)), (".weight_scale", "bfloat16", (6, 1)), (".weight_shape", "int64", (2,)),
    ]
    specs = linear_tensor_specs(MODULE, "w8a8", (6, 10), np.float16, static_act=True)
    assert [(s.name[len(MODULE):], s.dtype.name, s.shape) for s in specs] == [
        (".weight", "int8", (6, 10)), (".weight_scale", "float16", (6, 1)), (".input_scale", "float32", (1,)),
    ]


def test_nf4_layout_names_dtypes_and_shapes_are_as_documented():
    specs = linear_tensor_specs(MODULE, "nf4", (160, 129), ml_dtypes.bfloat16, double_quant=True)
    blob = json.dumps({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [160, 129],
                       "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 1.0})
    assert [(s.name[len(MODULE):], s.dtype.name, s.shape) for s in specs] == [
        (".weight", "uint8", (10320, 1)), (".weight.absmax", "uint8", (323,)), (".weight.quant_map", "float32", (16,)),
        (".weight.nested_absmax", "float32", (2,)), (".weight.nested_quant_map", "float32", (256,)),
        (".weight.quant_state.bitsandbytes__nf4", "uint8", (len(blob.replace("1.0", "1.000000000e+00")),)),
    ]


def test_packed_int8_on_disk_equals_an_independent_packing(tmp_path):
    q = int8_qarray(5, 11)
    folder = write_folder(tmp_path / "out", "int8", {MODULE: (q, None)})
    stored = torch_load_file(str(folder / "model.safetensors"))
    np.testing.assert_array_equal(stored[f"{MODULE}.weight_packed"].numpy(), independent_pack_int8(q.qvalue))
    assert stored[f"{MODULE}.weight_shape"].tolist() == [5, 11]
    assert stored[f"{MODULE}.weight_scale"].dtype == torch.bfloat16


@pytest.mark.parametrize("scheme, static", [("int8", False), ("w8a8", False), ("w8a8", True)])
def test_int8_schemes_round_trip_through_the_folder(tmp_path, scheme, static):
    items = {MODULE: (int8_qarray(6, 10), 0.25 if static else None),
             "model.layers.0.mlp.down_proj": (int8_qarray(10, 6, np.float32, seed=1), 0.5 if static else None)}
    norm = np.ones(10, ml_dtypes.bfloat16)
    folder = write_folder(tmp_path / "out", scheme, items, act="static" if static else "dynamic",
                          extra={"model.norm.weight": norm})
    checkpoint = open_quantized(folder)
    assert checkpoint.scheme == scheme
    assert checkpoint.quantized_modules == sorted(items)
    assert checkpoint.float_names == ["model.norm.weight"]
    for module, (q, input_scale) in items.items():
        back = checkpoint.qarray(module)
        assert back.kind == "int8" and back.shape == q.shape and back.dtype == q.dtype
        np.testing.assert_array_equal(np.asarray(back.qvalue), q.qvalue)
        np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))
        assert checkpoint.input_scale(module) == input_scale
    np.testing.assert_array_equal(checkpoint.get("model.norm.weight"), norm)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_round_trips_through_the_folder(tmp_path, double_quant):
    codes, q = nf4_codes_and_qarray(160, 129 if double_quant else 13)
    folder = write_folder(tmp_path / "out", "nf4", {MODULE: (q, None)}, double_quant=double_quant)
    checkpoint = open_quantized(folder)
    assert checkpoint.scheme == "nf4" and checkpoint.quantized_modules == [MODULE] and checkpoint.float_names == []
    back = checkpoint.qarray(MODULE)
    assert (back.kind, back.block_size, back.shape, back.dtype) == ("nf4", 64, q.shape, "bfloat16")
    np.testing.assert_array_equal(np.asarray(back.qvalue), q.qvalue)
    assert back.scale.dtype == np.float32
    stored = torch_load_file(str(folder / "model.safetensors"))
    # On disk: the packed bytes are the codes two to a byte, earlier element high.
    padded = np.append(codes, 0) if codes.size % 2 else codes
    np.testing.assert_array_equal(stored[f"{MODULE}.weight"].numpy().reshape(-1), padded[0::2] * 16 + padded[1::2])
    np.testing.assert_array_equal(stored[f"{MODULE}.weight.quant_map"].numpy(), bnb_functional.get_4bit_type("nf4", device="cpu").numpy())
    blob = json.loads(bytes(stored[f"{MODULE}.weight.quant_state.bitsandbytes__nf4"].numpy()).decode())
    if not double_quant:
        np.testing.assert_array_equal(np.asarray(back.scale), q.scale)
        np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(q.dequantize()))
        assert blob == {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [160, 13]}
        return
    assert set(blob) == {"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"}
    assert blob["nested_blocksize"] == 256 and blob["nested_dtype"] == "float32"
    # bitsandbytes' offset: torch's float32 mean of the absmax (one block count below torch's threading grain).
    assert np.float32(blob["nested_offset"]) == torch.from_numpy(q.scale).mean().item()
    # The decoded absmax is the documented formula over what is stored.
    code = bnb_functional.create_dynamic_map(signed=True).numpy()
    q_codes = stored[f"{MODULE}.weight.absmax"].numpy()
    nested = stored[f"{MODULE}.weight.nested_absmax"].numpy()
    expected = code[q_codes] * nested[np.arange(q_codes.size) // 256] + np.float32(blob["nested_offset"])
    np.testing.assert_array_equal(np.asarray(back.scale), expected.astype(np.float32))
    assert np.abs(np.asarray(back.scale) - q.scale).max() < 0.01


def nf4_state_from_folder(folder, module):
    stored = torch_load_file(str(folder / "model.safetensors"))
    prefix = f"{module}.weight."
    parts = {name[len(prefix):]: tensor for name, tensor in stored.items() if name.startswith(prefix)}
    return stored[f"{module}.weight"], bnb_functional.QuantState.from_dict(parts, device=torch.device("cpu"))


@pytest.mark.parametrize("double_quant, shape, dtype", [(False, (40, 50), "bfloat16"), (True, (160, 129), "float32"),
                                                        (False, (16, 64), "float16")])
def test_bitsandbytes_dequantizes_the_nf4_tensors_like_the_qarray(tmp_path, double_quant, shape, dtype):
    _, q = nf4_codes_and_qarray(*shape, dtype=dtype, seed=2)
    folder = write_folder(tmp_path / "out", "nf4", {MODULE: (q, None)}, double_quant=double_quant)
    packed, state = nf4_state_from_folder(folder, MODULE)
    assert state.quant_type == "nf4" and state.blocksize == 64 and tuple(state.shape) == shape
    assert state.nested == double_quant and state.dtype == getattr(torch, dtype)
    theirs = bnb_functional.dequantize_4bit(packed, state).to(torch.float32).numpy()
    ours = np.asarray(open_quantized(folder).qarray(MODULE).dequantize(), dtype=np.float32)
    np.testing.assert_array_equal(ours, theirs)


def decompress_with_compressed_tensors(folder, shapes, float_dtype):
    """Load the folder into a torch module tree the way transformers does, and decompress it."""
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    qconfig = QuantizationConfig.model_validate(config)
    model = torch.nn.Module()
    for module, (out_features, in_features) in shapes.items():
        parent = model
        for part in module.split(".")[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(module.split(".")[-1], torch.nn.Linear(in_features, out_features, bias=False, dtype=float_dtype))
    apply_quantization_config(model, qconfig)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    result = model.load_state_dict(torch_load_file(str(folder / "model.safetensors")), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    compressor.decompress_model(model)
    return model


@pytest.mark.parametrize("scheme, static", [("int8", False), ("w8a8", False), ("w8a8", True)])
def test_compressed_tensors_decompresses_to_codes_times_scale(tmp_path, scheme, static):
    q = int8_qarray(6, 10)
    head = np.random.default_rng(5).standard_normal((4, 6)).astype(ml_dtypes.bfloat16)
    folder = write_folder(tmp_path / "out", scheme, {MODULE: (q, 0.125 if static else None)},
                          act="static" if static else "dynamic", extra={"lm_head.weight": head})
    model = decompress_with_compressed_tensors(folder, {MODULE: (6, 10), "lm_head": (4, 6)}, torch.bfloat16)
    linear = model.get_submodule(MODULE)
    expected = (q.qvalue.astype(np.float32) * q.scale.astype(np.float32)).astype(ml_dtypes.bfloat16)
    assert linear.weight.dtype == torch.bfloat16
    np.testing.assert_array_equal(linear.weight.detach().to(torch.float32).numpy(), expected.astype(np.float32))
    if static:
        assert linear.input_scale.item() == 0.125
    np.testing.assert_array_equal(model.lm_head.weight.detach().to(torch.float32).numpy(), head.astype(np.float32))


def test_quantization_configs_are_exactly_as_documented():
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
               "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    dynamic_acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "group_size": None,
                    "dynamic": True, "actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {}}

    def ct(fmt, acts, ignore=("lm_head",)):
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
                "sparsity_config": {}, "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                     "input_activations": acts,
                                                                     "output_activations": None}}}

    assert quantization_config("w8a8") == ct("int-quantized", dynamic_acts)
    static_acts = dict(dynamic_acts, strategy="tensor", dynamic=False, observer="minmax")
    assert quantization_config("w8a8", act="static") == ct("int-quantized", static_acts)
    assert quantization_config("int8", ignore=("lm_head", "re:.*gate$")) == ct("pack-quantized", None,
                                                                              ("lm_head", "re:.*gate$"))
    assert quantization_config("nf4", double_quant=True, compute_dtype="float16") == {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
        "_load_in_4bit": True, "_load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": "float16", "bnb_4bit_quant_storage": "uint8",
        "llm_int8_threshold": 6.0, "llm_int8_skip_modules": ["lm_head"],
        "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
    }


def test_peer_libraries_parse_the_configs():
    from transformers import BitsAndBytesConfig

    for scheme, act in [("int8", "dynamic"), ("w8a8", "dynamic"), ("w8a8", "static")]:
        parsed = QuantizationConfig.model_validate(quantization_config(scheme, act=act))
        weights = parsed.config_groups["group_0"].weights
        assert (weights.num_bits, weights.strategy, weights.symmetric) == (8, "channel", True)
    bnb = BitsAndBytesConfig.from_dict(quantization_config("nf4", double_quant=True))
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert bnb.bnb_4bit_compute_dtype == torch.bfloat16


def test_each_config_reads_back_as_its_scheme():
    for scheme in ("int8", "w8a8", "nf4"):
        assert layout_for_config(quantization_config(scheme))[0].scheme == scheme
    for bad in [{"quant_method": "gptq"}, {"quant_method": "compressed-tensors", "format": "float-quantized"},
                {"quant_method": "bitsandbytes", "load_in_8bit": True}, []]:
        with pytest.raises(ValueError):
            layout_for_config(bad)


def test_unknown_scheme_is_refused():
    with pytest.raises(ValueError):
        linear_tensor_specs(MODULE, "int3", (2, 2), np.float32)
    with pytest.raises(ValueError):
        quantization_config("w8a8", act="sometimes")


def test_open_quantized_refuses_folders_that_are_not_quantized_checkpoints(tmp_path):
    folder = write_folder(tmp_path / "out", "int8", {MODULE: (int8_qarray(4, 4), None)})
    (folder / "config.json").write_text(json.dumps({"architectures": ["Test"]}))
    with pytest.raises(FormatError, match="no quantization_config"):
        open_quantized(folder)
    (folder / "config.json").write_text("{")
    with pytest.raises(FormatError, match="config.json"):
        open_quantized(folder)
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(FormatError, match="awq"):
        open_quantized(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FormatError, match="missing"):
        open_quantized(folder)


def test_inconsistent_quantized_tensors_are_reported_by_file(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    tensors = {f"{MODULE}.weight_packed": np.zeros((4, 2), np.int32),
               f"{MODULE}.weight_scale": np.ones((4, 1), np.float32),
               f"{MODULE}.weight_shape": np.array([4, 12], np.int64)}
    write_shards(folder, [TensorSpec(k, v.dtype, v.shape) for k, v in tensors.items()], tensors.items(), 1 << 20)
    (folder / "config.json").write_text(json.dumps({"quantization_config": quantization_config("int8")}))
    with pytest.raises(FormatError, match=r"model\.safetensors.*weight_shape"):
        open_quantized(folder).qarray(MODULE)


def test_corrupt_nf4_quant_state_is_reported(tmp_path):
    _, q = nf4_codes_and_qarray(4, 16)
    folder = write_folder(tmp_path / "out", "nf4", {MODULE: (q, None)})
    stored = {k: v.numpy() for k, v in torch_load_file(str(folder / "model.safetensors")).items()}
    stored[f"{MODULE}.weight.quant_state.bitsandbytes__nf4"] = np.frombuffer(b'{"quant_type": "fp4"}', np.uint8).copy()
    stored[f"{MODULE}.weight.quant_map"] = NF4_LEVELS.copy()
    (folder / "model.safetensors").unlink()
    write_shards(folder, [TensorSpec(k, v.dtype, v.shape) for k, v in stored.items()], stored.items(), 1 << 20)
    with pytest.raises(FormatError, match="quant_state"):
        open_quantized(folder).qarray(MODULE)
