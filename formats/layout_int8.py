"""int8 weight-only (W8A16): compressed-tensors `pack-quantized`, 8 bits, four codes to an int32 word.

    <m>.weight_packed  int32 [out, ceil(in/4)]   u = q + 128, column 4k+j in bits 8j..8j+7 of word k
    <m>.weight_scale   model float dtype [out, 1]
    <m>.weight_shape   int64 [2] = (out, in)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.layout_base import LayoutFlags, TensorSource
from qconvert.formats.packing import pack_int8_to_int32, unpack_int32_to_int8
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

FORMAT = "pack-quantized"


class PackQuantizedInt8(ct.CompressedTensorsInt8):
    """`--scheme int8`: per-output-channel int8 codes packed into int32, float activations."""

    scheme = "int8"
    format = FORMAT
    marker_suffix = ".weight_packed"
    part_suffixes = (".weight_packed", ".weight_scale", ".weight_shape")

    def claims(self, qconfig: dict[str, Any]) -> bool:
        # pack-quantized also holds int4 (layout_int4); every other width is this layout's to refuse.
        return super().claims(qconfig) and ct.weight_bits(qconfig) != {4}

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        return [
            TensorSpec(f"{module}.weight_packed", np.int32, (out_features, -(-in_features // 4))),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, 1)),
            TensorSpec(f"{module}.weight_shape", np.int64, (2,)),
        ]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        ct.check_int8_qarray(module, q, self.scheme)
        return {
            f"{module}.weight_packed": pack_int8_to_int32(np.asarray(q.qvalue, dtype=np.int8)),
            f"{module}.weight_scale": np.asarray(q.scale).reshape(q.shape[0], 1),
            f"{module}.weight_shape": np.array(q.shape, dtype=np.int64),
        }

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        scale, shape, packed = ct.packed_weight(source, module, 4)
        return ct.int8_qarray(source, module, unpack_int32_to_int8(packed, shape[1]), scale)

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        return ct.config(FORMAT, None, ignore)

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        acts = ct.input_activations(qconfig)
        if acts is not None:
            raise ValueError(f"compressed-tensors {FORMAT} config quantizes input activations; qconvert's "
                             "int8 layout keeps them in float (input_activations null)")
        return LayoutFlags()
