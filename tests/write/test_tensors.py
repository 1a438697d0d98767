"""The writer's tensors (qconvert.write.tensors): what calibration hands in beside the plan lands where it belongs."""

import dataclasses
import json
import struct

import numpy as np
from safetensors.numpy import load_file

from checkpoints import make_llama_checkpoint
import qconvert.convert as convert_module
from qconvert.convert import ConvertOptions, convert

K_SCALE = "model.layers.0.self_attn.k_scale"


def file_order(path) -> list[str]:
    """A safetensors file's tensor names in the order of their bytes, read from its JSON header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


def test_an_extra_tensor_from_calibration_is_written_right_after_its_modules_tensors(tmp_path, monkeypatch):
    source = make_llama_checkpoint(tmp_path / "src", layers=2)
    k_scale = np.array([0.25], np.float32)
    real = convert_module._calibrated

    def with_k_scale(adjustments, options):
        return dataclasses.replace(real(adjustments, options), extra_tensors={K_SCALE: k_scale})

    monkeypatch.setattr(convert_module, "_calibrated", with_k_scale)
    convert(str(source), tmp_path / "out", ConvertOptions(scheme="int8"))
    order = file_order(tmp_path / "out" / "model.safetensors")
    attention = [k for k, name in enumerate(order) if name.startswith("model.layers.0.self_attn.") and name != K_SCALE]
    assert order.index(K_SCALE) == max(attention) + 1
    np.testing.assert_array_equal(load_file(tmp_path / "out" / "model.safetensors")[K_SCALE], k_scale)
