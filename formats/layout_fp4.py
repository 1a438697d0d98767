"""FP4 weight-only layouts: compressed-tensors `nvfp4-pack-quantized` (NVFP4A16) and `mxfp4-pack-quantized`
(MXFP4A16). docs/FORMATS.md (FP4) has the rules.

    nvfp4a16:
    <m>.weight_packed        uint8 [out, in/2]      E2M1 codes, column 2k in the low nibble of byte k, 2k+1 high
    <m>.weight_scale         float8_e4m3fn [out, in/16]  each group of 16 input columns' scale
    <m>.weight_global_scale  float32 [1]            the tensor's second-level scale g (a divisor)
    value = E2M1[code] * (scale / g), the quotient in float32

    nvfp4 (W4A4): the nvfp4a16 tensors, and
    <m>.input_global_scale   float32 [1]            448 * 6 / max|x| of the calibrated inputs (a divisor, as g)
    the activations are rounded at run time per token and group of 16 inputs, E4M3 group scales over it

    mxfp4a16:
    <m>.weight_packed        uint8 [out, in/2]      as above
    <m>.weight_scale         uint8 [out, in/32]     E8M0: the group scale is 2^(byte - 127)
    value = E2M1[code] * 2^(byte - 127)

A code's bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import Layout, LayoutFlags, TensorSource
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

NVFP4_FORMAT = "nvfp4-pack-quantized"
MXFP4_FORMAT = "mxfp4-pack-quantized"
E8M0_BIAS = 127
E8M0_NAN = 255
INPUT_GLOBAL_SCALE = ".input_global_scale"


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """uint8 [out, in/2] of uint8 E2M1 codes [out, in] (in even): the earlier column in the low nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[:, 0::2] & 0xF) | (codes[:, 1::2] & 0xF) << 4


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """uint8 codes [out, 2 * cols] of packed bytes [out, cols]."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def fp4_args(group_size: int, strategy: str, scale_dtype: str, dynamic: Any = False,
             observer: str | None = "minmax") -> dict:
    """A symmetric 4-bit float QuantizationArgs object, with the key set the int layouts write and the scale's
    dtype compressed-tensors' presets name."""
    return {**ct.int_args(4, strategy, dynamic, observer, group_size=group_size), "type": "float",
            "scale_dtype": scale_dtype, "zp_dtype": scale_dtype}


def _is_fp4(args: Any, group_size: int, strategy: str) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "float"
            and args.get("symmetric", True) is True and args.get("strategy") == strategy
            and args.get("group_size") == group_size)


class FP4Packed(Layout):
    """E2M1 codes packed two to a byte, one scale per group of input columns."""

    qarray_kind = "fp4"
    quant_method = ct.QUANT_METHOD
    # compressed-tensors decompresses FP4 weights to bf16 whatever the model's dtype, and a float32 or float16
    # model's matmuls then refuse them.
    transformers_dtype = "bfloat16"
    marker_suffix = ".weight_packed"
    format: str
    group_size: int
    strategy: str
    scale_dtype_name: str

    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        return ct.loader_quantizes(qconfig, module)

    def _check(self, module: str, q: QArray) -> None:
        if q.kind != self.qarray_kind or q.ndim != 2 or q.block_size != self.group_size:
            raise ValueError(f"{module}: scheme {self.scheme} needs a 2-D fp4 QArray in groups of {self.group_size}, "
                             f"got kind {q.kind} {q.shape} groups of {q.block_size}")

    def _codes(self, source: TensorSource, module: str, scale: np.ndarray) -> np.ndarray:
        packed = source.tensor(f"{module}.weight_packed", [np.uint8], 2)
        if scale.shape[0] != packed.shape[0] or scale.shape[1] * self.group_size != 2 * packed.shape[1]:
            raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale "
                              f"{list(scale.shape)} does not fit weight_packed {list(packed.shape)} (groups of "
                              f"{self.group_size} input columns, two columns a byte)")
        return unpack_fp4(packed)

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        return ct.config(self.format, None, ignore,
                         fp4_args(self.group_size, self.strategy, self.scale_dtype_name))

    def claims(self, qconfig: dict[str, Any]) -> bool:
        groups = qconfig.get("config_groups")
        return (ct.claims(qconfig, self.format) and isinstance(groups, dict)
                and all(isinstance(g, dict) and g.get("input_activations") is None for g in groups.values()))

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        for name, group in qconfig["config_groups"].items():
            weights = group.get("weights")
            if not _is_fp4(weights, self.group_size, self.strategy):
                shown = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy", "group_size")} \
                    if isinstance(weights, dict) else weights
                raise ValueError(f"compressed-tensors {self.format} group {name} weights are {shown}; qconvert "
                                 f"reads symmetric 4-bit float weights, strategy {self.strategy}, groups of "
                                 f"{self.group_size}")
        return LayoutFlags()


class NVFP4PackQuantized(FP4Packed):
    """`--scheme nvfp4a16`: E2M1 codes, E4M3 scales per group of 16, a float32 global scale per tensor."""

    scheme = "nvfp4a16"
    format = NVFP4_FORMAT
    group_size = 16
    strategy = "tensor_group"
    scale_dtype_name = "torch.float8_e4m3fn"
    part_suffixes = (".weight_packed", ".weight_scale", ".weight_global_scale")

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        return [
            TensorSpec(f"{module}.weight_packed", np.uint8, (out_features, in_features // 2)),
            TensorSpec(f"{module}.weight_scale", ml_dtypes.float8_e4m3fn, (out_features, in_features // 16)),
            TensorSpec(f"{module}.weight_global_scale", np.float32, (1,)),
        ]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        self._check(module, q)
        if q.zero_point is None:
            raise ValueError(f"{module}: an NVFP4 QArray carries its global scale")
        return {
            f"{module}.weight_packed": pack_fp4(q.qvalue),
            f"{module}.weight_scale": np.asarray(q.scale, np.float32).astype(ml_dtypes.float8_e4m3fn),
            f"{module}.weight_global_scale": np.asarray(q.zero_point, np.float32).reshape(1),
        }

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        scale = source.tensor(f"{module}.weight_scale", [ml_dtypes.float8_e4m3fn], 2).astype(np.float32)
        codes = self._codes(source, module, scale)
        name = f"{module}.weight_global_scale"
        global_scale = source.tensor(name, [np.float32], 1)
        if global_scale.shape != (1,) or not np.isfinite(global_scale).all() or global_scale[0] <= 0:
            raise FormatError(f"{source.file_of(name)}: {module} weight_global_scale {global_scale.tolist()} is "
                              "not one positive finite float32")
        if not np.isfinite(scale).all():
            raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale has NaN values")
        return QArray(qvalue=codes, scale=scale, zero_point=global_scale.reshape(1, 1), kind=self.qarray_kind,
                      block_size=self.group_size, shape=codes.shape, dtype=source.float_dtype)


class NVFP4W4A4(NVFP4PackQuantized):
    """`--scheme nvfp4`: NVFP4A16's tensors and a calibrated float32 `input_global_scale` per linear; the config's
    input activations are 4-bit floats in groups of 16, dynamic "local" (group scales at run time), as
    compressed-tensors' NVFP4 preset."""

    scheme = "nvfp4"
    part_suffixes = (*NVFP4PackQuantized.part_suffixes, INPUT_GLOBAL_SCALE)
    takes_input_scale = True

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        return [*super().tensor_specs(module, shape, float_dtype, flags),
                TensorSpec(f"{module}{INPUT_GLOBAL_SCALE}", np.float32, (1,))]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        if input_scale is None or not np.isfinite(input_scale) or input_scale <= 0:
            raise ValueError(f"{module}: an NVFP4 W4A4 linear needs a positive calibrated input global scale, "
                             f"got {input_scale!r}")
        return {**super().to_tensors(module, q, flags),
                f"{module}{INPUT_GLOBAL_SCALE}": np.array([input_scale], np.float32)}

    def read_input_scale(self, source: TensorSource, module: str) -> float:
        """The linear's input global scale (FormatError naming the file unless one positive finite float32)."""
        name = f"{module}{INPUT_GLOBAL_SCALE}"
        if name not in source:
            raise FormatError(f"{module}: the folder's config quantizes activations to NVFP4 but it has no {name}")
        value = source.tensor(name, [np.float32], 1)
        if value.shape != (1,) or not np.isfinite(value).all() or value[0] <= 0:
            raise FormatError(f"{source.file_of(name)}: {module} input_global_scale {value.tolist()} is not one "
                              "positive finite float32")
        return float(value[0])

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        config = super().quantization_config(flags, ignore, compute_dtype)
        config["config_groups"]["group_0"]["input_activations"] = nvfp4_input_args()
        return config

    def claims(self, qconfig: dict[str, Any]) -> bool:
        groups = qconfig.get("config_groups")
        return (ct.claims(qconfig, self.format) and isinstance(groups, dict) and bool(groups)
                and all(isinstance(g, dict) and g.get("input_activations") is not None for g in groups.values()))

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        for name, group in qconfig["config_groups"].items():
            acts = group.get("input_activations")
            if not (_is_fp4(acts, self.group_size, self.strategy) and acts.get("dynamic") == "local"):
                shown = {k: acts.get(k) for k in ("num_bits", "type", "strategy", "group_size", "dynamic")} \
                    if isinstance(acts, dict) else acts
                raise ValueError(f"compressed-tensors {self.format} group {name} input activations are {shown}; "
                                 "qconvert's nvfp4 layout reads 4-bit float activations in groups of 16, strategy "
                                 "tensor_group, dynamic local (NVFP4)")
        return super().flags_of(qconfig)


def nvfp4_input_args() -> dict:
    """The NVFP4 preset's input_activations: E2M1 in groups of 16 with E4M3 scales found at run time ("local"),
    over a calibrated global scale (the static_minmax observer)."""
    return fp4_args(NVFP4PackQuantized.group_size, NVFP4PackQuantized.strategy, NVFP4PackQuantized.scale_dtype_name,
                    dynamic="local", observer="static_minmax")


class MXFP4PackQuantized(FP4Packed):
    """`--scheme mxfp4a16`: E2M1 codes, E8M0 (power-of-two) scales per group of 32."""

    scheme = "mxfp4a16"
    format = MXFP4_FORMAT
    group_size = 32
    strategy = "group"
    scale_dtype_name = "torch.uint8"
    part_suffixes = (".weight_packed", ".weight_scale")

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        return [
            TensorSpec(f"{module}.weight_packed", np.uint8, (out_features, in_features // 2)),
            TensorSpec(f"{module}.weight_scale", np.uint8, (out_features, in_features // 32)),
        ]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        self._check(module, q)
        exponent = np.floor(np.log2(np.asarray(q.scale, np.float32))) + E8M0_BIAS
        if not ((exponent >= 0) & (exponent <= 255)).all():
            raise ValueError(f"{module}: an MXFP4 scale outside E8M0's range")
        return {
            f"{module}.weight_packed": pack_fp4(q.qvalue),
            f"{module}.weight_scale": exponent.astype(np.uint8),
        }

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        exponent = source.tensor(f"{module}.weight_scale", [np.uint8], 2)
        if (exponent == E8M0_NAN).any():
            raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale holds E8M0's NaN "
                              f"byte {E8M0_NAN}")
        codes = self._codes(source, module, exponent)
        scale = np.exp2(exponent.astype(np.float32) - E8M0_BIAS).astype(np.float32)
        return QArray(qvalue=codes, scale=scale, kind=self.qarray_kind, block_size=self.group_size,
                      shape=codes.shape, dtype=source.float_dtype)
