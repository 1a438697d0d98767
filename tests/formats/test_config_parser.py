"""The one quantization_config parser: configs built by the peer libraries are recognised with their flags,
and settings qconvert's layouts do not store (bit width, strategy, activations, storage) are refused clearly."""

import json

import ml_dtypes
import numpy as np
import pytest
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization import preset_name_to_scheme
from transformers import BitsAndBytesConfig

from cli_helpers import run
from qconvert.formats.errors import FormatError
from qconvert.formats.layouts import LAYOUTS, LayoutFlags, layout_for, layout_for_config
from qconvert.formats.layouts import linear_tensor_specs, open_quantized, qarray_to_tensors, quantization_config
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import write_shards


def compressed_tensors_config(fmt, weights, input_activations=None, groups=1):
    """A quantization_config as compressed-tensors itself serializes it."""
    scheme = dict(targets=["Linear"], weights=weights, input_activations=input_activations)
    config = QuantizationConfig(config_groups={f"group_{i}": QuantizationScheme(**scheme) for i in range(groups)},
                                format=fmt, quantization_status="compressed", ignore=["lm_head"])
    return json.loads(config.model_dump_json())


INT8_CHANNEL = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
INT8_TOKEN = dict(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
INT8_TENSOR = dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)


@pytest.mark.parametrize("fmt, acts, scheme, flags", [
    ("pack-quantized", None, "int8", LayoutFlags()),
    ("int-quantized", INT8_TOKEN, "w8a8", LayoutFlags(static_act=False)),
    ("int-quantized", INT8_TENSOR, "w8a8", LayoutFlags(static_act=True)),
])
def test_compressed_tensors_configs_are_recognised_with_their_activation_flag(fmt, acts, scheme, flags):
    qconfig = compressed_tensors_config(fmt, QuantizationArgs(**INT8_CHANNEL),
                                        QuantizationArgs(**acts) if acts else None, groups=2)
    layout, found = layout_for_config(qconfig)
    assert (layout.scheme, found) == (scheme, flags)


def test_the_compressed_tensors_w8a8_preset_is_w8a8_with_dynamic_activations():
    qconfig = compressed_tensors_config("int-quantized", **{
        k: v for k, v in preset_name_to_scheme("W8A8", ["Linear"]).model_dump().items()
        if k in ("weights", "input_activations")})
    assert layout_for_config(qconfig) == (layout_for("w8a8"), LayoutFlags(static_act=False))


@pytest.mark.parametrize("fmt, weights, acts, words", [
    # A 2-bit pack-quantized model is neither an int8 nor an int4 one, whatever its format says.
    ("pack-quantized", dict(num_bits=2, type="int", symmetric=True, strategy="channel"), None, "8-bit"),
    ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="tensor"), None,
     "zero points per group or per output channel"),
    ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128), INT8_TOKEN,
     "keeps them in float"),
    ("pack-quantized", dict(num_bits=8, type="int", symmetric=True, strategy="group", group_size=128), None,
     "per output channel"),
    ("pack-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="channel"), None, "symmetric"),
    ("pack-quantized", INT8_CHANNEL, INT8_TOKEN, "keeps them in float"),
    ("int-quantized", INT8_CHANNEL, None, "input activations"),
    ("int-quantized", INT8_CHANNEL, dict(INT8_TOKEN, num_bits=4), "input activations"),
    ("int-quantized", INT8_CHANNEL, dict(INT8_TENSOR, dynamic=True), "per-tensor static"),
])
def test_settings_the_layouts_do_not_store_are_refused_by_name(fmt, weights, acts, words):
    qconfig = compressed_tensors_config(fmt, QuantizationArgs(**weights), QuantizationArgs(**acts) if acts else None)
    with pytest.raises(ValueError, match=words):
        layout_for_config(qconfig)


def test_the_compressed_tensors_w4a16_preset_is_int4_with_groups_of_128():
    qconfig = compressed_tensors_config("pack-quantized", preset_name_to_scheme("W4A16", ["Linear"]).weights)
    assert layout_for_config(qconfig) == (layout_for("int4"), LayoutFlags(group_size=128))


@pytest.mark.parametrize("double_quant", [False, True])
def test_bitsandbytes_nf4_configs_are_recognised_with_their_double_quant_flag(double_quant):
    qconfig = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_use_double_quant=double_quant).to_dict()
    assert layout_for_config(qconfig) == (layout_for("nf4"), LayoutFlags(double_quant=double_quant))


@pytest.mark.parametrize("settings, words", [
    (dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "not 4-bit nf4"),
    (dict(load_in_8bit=True), "not 4-bit nf4"),
    (dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage="float16"), "uint8"),
])
def test_bitsandbytes_configs_nf4_does_not_store_are_refused(settings, words):
    with pytest.raises(ValueError, match=words):
        layout_for_config(BitsAndBytesConfig(**settings).to_dict())


def test_each_layout_claims_only_its_own_configs():
    for layout in LAYOUTS:
        own = quantization_config(layout.scheme)
        assert [other.scheme for other in LAYOUTS if other.claims(own)] == [layout.scheme]


def test_a_folder_whose_config_describes_2_bit_weights_is_refused_with_exit_code_6(tmp_path, capsys):
    rng = np.random.default_rng(0)
    module = "model.layers.0.mlp.up_proj"
    q = QArray(qvalue=rng.integers(-127, 128, (4, 8)).astype(np.int8),
               scale=rng.uniform(0.01, 0.02, (4, 1)).astype(ml_dtypes.bfloat16), kind="int8", shape=(4, 8),
               dtype="bfloat16")
    specs = linear_tensor_specs(module, "int8", q.shape, q.scale.dtype)
    tensors = qarray_to_tensors(module, q, "int8")
    write_shards(tmp_path, specs, ((s.name, tensors[s.name]) for s in specs), max_shard_size=1 << 30)
    qconfig = quantization_config("int8")
    qconfig["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Test"], "quantization_config": qconfig}))
    with pytest.raises(FormatError, match="config.json: .*8-bit"):
        open_quantized(tmp_path)
    exit_code, stdout, stderr = run(["inspect", str(tmp_path)], capsys)
    assert exit_code == 6 and stdout == ""
    assert len(stderr.strip().splitlines()) == 1 and "num_bits" in stderr


def test_static_per_token_activations_which_compressed_tensors_forbids_are_refused():
    qconfig = quantization_config("w8a8")
    qconfig["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match="per-token dynamic or per-tensor static"):
        layout_for_config(qconfig)
