"""int4 weight-only (W4A16): compressed-tensors `pack-quantized`, 4 bits, one scale per output row and group.

    <m>.weight_packed  int32 [out, ceil(in/8)]        u = q + 8, column 8k+j in bits 4j..4j+3 of word k
    <m>.weight_scale   model float dtype [out, in/group]  ([out, 1] per channel)
    <m>.weight_shape   int64 [2] = (out, in)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import Layout, LayoutFlags, TensorSource
from qconvert.formats.packing import pack_int4_to_int32, unpack_int32_to_int4
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

FORMAT = "pack-quantized"


def float_activations(qconfig: dict[str, Any]) -> bool:
    """Whether a config group quantizes its input activations to a float type (FP8)."""
    groups = qconfig.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
        and g["input_activations"].get("type") == "float" for g in groups.values())


class PackQuantizedInt4(Layout):
    """`--scheme int4`: symmetric int4 codes packed eight to an int32 word, group scales, float activations."""

    scheme = "int4"
    qarray_kind = "int4"
    quant_method = ct.QUANT_METHOD
    marker_suffix = ".weight_packed"
    part_suffixes = (".weight_packed", ".weight_scale", ".weight_shape")
    # The weights flags_of reads: their config's `symmetric`, and what its refusals say of them.
    symmetric = True
    weights_read = "symmetric int4 weights per group or per output channel only"

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        groups = in_features // flags.group_size if flags.group_size else 1
        return [
            TensorSpec(f"{module}.weight_packed", np.int32, (out_features, -(-in_features // 8))),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, groups)),
            TensorSpec(f"{module}.weight_shape", np.int64, (2,)),
        ]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        if q.kind != self.qarray_kind or q.ndim != 2 or q.zero_point is not None:
            raise ValueError(f"{module}: scheme int4 needs a 2-D symmetric int4 QArray, got kind {q.kind} {q.shape}")
        return {
            f"{module}.weight_packed": pack_int4_to_int32(np.asarray(q.qvalue, dtype=np.int8)),
            f"{module}.weight_scale": np.asarray(q.scale),
            f"{module}.weight_shape": np.array(q.shape, dtype=np.int64),
        }

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        scale, shape, packed = ct.packed_weight(source, module, 8)
        groups = scale.shape[1]
        if scale.shape[0] != shape[0] or groups < 1 or shape[1] % groups:
            raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale "
                              f"{list(scale.shape)} does not fit weight_shape {list(shape)}")
        return QArray(qvalue=unpack_int32_to_int4(packed, shape[1]), scale=scale, kind=self.qarray_kind,
                      block_size=shape[1] // groups if groups > 1 else None, shape=shape, dtype=scale.dtype.name)

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        if flags.group_size:
            weights = ct.int_args(4, "group", False, "minmax", group_size=flags.group_size)
        else:
            weights = ct.int_args(4, "channel", False, "minmax")
        return ct.config(FORMAT, None, ignore, weights)

    def claims(self, qconfig: dict[str, Any]) -> bool:
        # A group quantizing activations to a float type is W4A8-FP8's (layout_w4a8); zero points (symmetric
        # false) are int4-asym's.
        return (ct.claims(qconfig, FORMAT) and ct.weight_bits(qconfig) == {4} and not float_activations(qconfig)
                and not ct.weights_asymmetric(qconfig))

    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        return ct.loader_quantizes(qconfig, module)

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        sizes = set()
        for name, group in qconfig["config_groups"].items():
            weights = group.get("weights") or {}
            if (weights.get("type", "int") != "int" or weights.get("symmetric", True) is not self.symmetric
                    or weights.get("strategy") not in ("group", "channel")):
                raise ValueError(f"compressed-tensors {FORMAT} group {name} 4-bit weights are "
                                 f"{ {k: weights.get(k) for k in ('type', 'symmetric', 'strategy')} }; qconvert "
                                 f"reads {self.weights_read}")
            if group.get("input_activations") is not None:
                raise ValueError(f"compressed-tensors {FORMAT} config quantizes input activations; qconvert's "
                                 f"{self.scheme} layout keeps them in float (input_activations null)")
            sizes.add(weights.get("group_size") if weights.get("strategy") == "group" else None)
        if len(sizes) != 1:
            raise ValueError(f"compressed-tensors {FORMAT} groups use different group sizes {sorted(map(str, sizes))}")
        return LayoutFlags(group_size=sizes.pop())
