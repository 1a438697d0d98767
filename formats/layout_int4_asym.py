"""int4 with zero points (W4A16_ASYM): compressed-tensors `pack-quantized`, 4 bits, a scale and a zero point
per output row and group.

    <m>.weight_packed      int32 [out, ceil(in/8)]         u = q + 8, column 8k+j in bits 4j..4j+3 of word k
    <m>.weight_scale       model float dtype [out, in/group]  ([out, 1] per channel)
    <m>.weight_zero_point  int32 [ceil(out/8), in/group]   z + 8, packed along the OUTPUT dimension: row 8k+j of
                                                            a column in bits 4j..4j+3 of word k
    <m>.weight_shape       int64 [2] = (out, in)

A loader computes (q - z) * scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import LayoutFlags, TensorSource
from qconvert.formats.layout_int4 import FORMAT, PackQuantizedInt4
from qconvert.formats.packing import pack_int4_to_int32, unpack_int32_to_int4
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

ZERO_POINT = ".weight_zero_point"


def pack_zero_points(zero: np.ndarray) -> np.ndarray:
    """int8 zero points [out, groups] in [-8, 7] -> int32 [ceil(out/8), groups]: pack_to_int32 along dim 0."""
    return np.ascontiguousarray(pack_int4_to_int32(np.ascontiguousarray(np.asarray(zero).T)).T)


def unpack_zero_points(packed: np.ndarray, rows: int) -> np.ndarray:
    """int32 [ceil(rows/8), groups] -> int8 zero points [rows, groups]; the inverse of pack_zero_points."""
    return np.ascontiguousarray(unpack_int32_to_int4(np.ascontiguousarray(np.asarray(packed).T), rows).T)


class PackQuantizedInt4Asym(PackQuantizedInt4):
    """`--scheme int4-asym`: int4 codes packed eight to an int32 word, group scales and packed zero points."""

    scheme = "int4-asym"
    part_suffixes = (".weight_packed", ".weight_scale", ZERO_POINT, ".weight_shape")
    symmetric = False
    weights_read = "int4 weights with zero points per group or per output channel, in every group alike"
    # transformers 5.24's compressed load (compressed-tensors 0.20's compress_model on meta weights) allocates
    # weight_zero_point unpacked, [out, groups], and re-initializes the packed one every W4A16_ASYM checkpoint
    # stores; decompressing at load reads it right.
    transformers_quantization_config = "CompressedTensorsConfig(dequantize=True)"

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        groups = in_features // flags.group_size if flags.group_size else 1
        specs = super().tensor_specs(module, shape, float_dtype, flags)
        return specs[:2] + [TensorSpec(module + ZERO_POINT, np.int32, (-(-out_features // 8), groups))] + specs[2:]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        if q.kind != self.qarray_kind or q.ndim != 2 or q.zero_point is None:
            raise ValueError(f"{module}: scheme int4-asym needs a 2-D int4 QArray with zero points, got kind "
                             f"{q.kind} {q.shape}")
        symmetric = super().to_tensors(module, dataclasses.replace(q, zero_point=None), flags)
        tensors = dict(list(symmetric.items())[:2])
        tensors[module + ZERO_POINT] = pack_zero_points(np.asarray(q.zero_point, np.int8))
        tensors[f"{module}.weight_shape"] = symmetric[f"{module}.weight_shape"]
        return tensors

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        q = super().read_qarray(source, module)
        packed = source.tensor(module + ZERO_POINT, [np.int32], 2)
        rows, groups = q.shape[0], np.shape(q.scale)[1]
        if packed.shape != (-(-rows // 8), groups):
            raise FormatError(f"{source.file_of(module + ZERO_POINT)}: {module} weight_zero_point "
                              f"{list(packed.shape)} does not fit weight_shape {list(q.shape)} in {groups} groups")
        return dataclasses.replace(q, zero_point=unpack_zero_points(packed, rows))

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        qconfig = super().quantization_config(flags, ignore, compute_dtype)
        qconfig["config_groups"]["group_0"]["weights"]["symmetric"] = False
        return qconfig

    def claims(self, qconfig: dict[str, Any]) -> bool:
        return ct.claims(qconfig, FORMAT) and ct.weight_bits(qconfig) == {4} and ct.weights_asymmetric(qconfig)
