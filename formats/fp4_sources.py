"""FP4-shipped weights read as float, a block of rows at a time: compressed-tensors `nvfp4-pack-quantized` and
`mxfp4-pack-quantized`, and gpt-oss's MXFP4 (transformers' `quant_method: mxfp4`).

    nvfp4-pack-quantized:
    <m>.weight_packed        uint8 [out, in/2]            E2M1 codes, column 2k in the low nibble of byte k
    <m>.weight_scale         float8_e4m3fn [out, in/16]   each group of 16 columns' scale
    <m>.weight_global_scale  float32 [1]                  the tensor's global scale g (a divisor)
    value = E2M1[code] x (scale / g): the quotient and the product in float32 (compressed-tensors' decompression),
    rounded once to the checkpoint's dtype

    mxfp4-pack-quantized:
    <m>.weight_packed        uint8 [out, in/2]            as above
    <m>.weight_scale         uint8 [out, in/32]           E8M0: 2^(byte - 127)
    value = E2M1[code] x 2^(byte - 127), rounded to the checkpoint's dtype (exact but out of range)

    gpt-oss MXFP4 (experts only):
    <e>.gate_up_proj_blocks  uint8 [experts, 2 x intermediate, hidden/32, 16]  32 E2M1 codes a group, the
                             earlier column in the low nibble
    <e>.gate_up_proj_scales  uint8 [experts, 2 x intermediate, hidden/32]      E8M0: 2^(byte - 127)
    (down_proj_blocks and down_proj_scales alike, [experts, hidden, intermediate/32, ...])
    value = E2M1[code] x 2^(byte - 127), rounded to the checkpoint's dtype; each expert's [rows, columns] is
    transposed, so the float tensor is `<e>.gate_up_proj` [experts, hidden, 2 x intermediate] as transformers
    dequantizes it (integrations/mxfp4.py) and as the float release stores it.

An E2M1 code's bit 3 is its sign; bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qconvert.formats.errors import FormatError, InvalidCheckpointError
from qconvert.formats.int4_sources import PACKED, SCALE, PackedWeight, packed_weights
from qconvert.formats.layout_fp4 import E8M0_BIAS, unpack_fp4
from qconvert.formats.quantized_sources import SourceFormat, check_finite
from qconvert.formats.safetensors_io import SafetensorsCheckpoint

_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([_MAGNITUDES, -_MAGNITUDES])  # by code: bit 3 the sign
GLOBAL_SCALE = ".weight_global_scale"
BLOCKS, SCALES = "_blocks", "_scales"
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))



def _packed_shape(stored: SafetensorsCheckpoint, packed: str) -> tuple[int, int]:
    """The [out, in] weight a uint8 [out, in/2] tensor of two E2M1 codes a byte stands for; FormatError for any
    other dtype or rank."""
    if stored.dtype(packed) != np.uint8 or len(stored.shape(packed)) != 2:
        raise FormatError(f"{stored.file_of(packed)}: {packed} is {stored.dtype(packed)} {list(stored.shape(packed))}, "
                          "not uint8 [out, in/2] (two E2M1 codes a byte); the packing does not match the format")
    out_features, half = stored.shape(packed)
    return int(out_features), 2 * int(half)

class NVFP4Weight(PackedWeight):
    """One nvfp4-pack-quantized linear: E2M1 codes, an E4M3 scale per row and 16 columns, a global scale."""

    def __init__(self, stored: SafetensorsCheckpoint, module: str, fmt: SourceFormat):
        self.stored, self.module = stored, module
        packed, scale, global_scale = (module + s for s in (PACKED, SCALE, GLOBAL_SCALE))
        where = stored.file_of(packed)
        self.shape = _packed_shape(stored, packed)
        for name, what in ((scale, "scale"), (global_scale, "global scale")):
            if name not in stored:
                raise FormatError(f"{where}: {packed} is stored but {name} is missing; a {fmt.name} checkpoint "
                                  f"has a {what} beside every packed weight")
        expected = (self.shape[0], -(-self.shape[1] // 16))
        if stored.dtype(scale) != E4M3 or tuple(stored.shape(scale)) != expected:
            raise FormatError(f"{stored.file_of(scale)}: {scale} is {stored.dtype(scale)} "
                              f"{list(stored.shape(scale))}, but the scales of a {list(self.shape)} {fmt.name} "
                              f"weight are float8_e4m3fn {list(expected)} (one per 16 columns)")
        if stored.dtype(global_scale) not in FLOAT_DTYPES or int(np.prod(stored.shape(global_scale))) != 1:
            raise FormatError(f"{stored.file_of(global_scale)}: {global_scale} is {stored.dtype(global_scale)} "
                              f"{list(stored.shape(global_scale))}, not one float (the tensor's global scale)")
        self.parts = (packed, scale, global_scale)

    def fill(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows [start, stop): E2M1 x (scale / g) in float32, rounded once to out's dtype."""
        stored, (packed, scale_name, global_name) = self.stored, self.parts
        global_scale = check_finite(stored.get(global_name), f"{stored.file_of(global_name)}: {global_name}",
                                    "nvfp4").reshape(())
        if global_scale == 0:
            raise InvalidCheckpointError(f"{stored.file_of(global_name)}: {global_name} is 0, so the nvfp4 weight "
                                         "it divides cannot be read; the checkpoint is corrupt")
        scale = check_finite(stored.get_rows(scale_name, start, stop), f"{stored.file_of(scale_name)}: {scale_name}",
                             "nvfp4")
        effective = scale / global_scale  # float32, as compressed-tensors divides
        values = E2M1_VALUES[unpack_fp4(stored.get_rows(packed, start, stop))]
        values *= np.repeat(effective, 16, axis=1)[:, :self.shape[1]]
        np.copyto(out, values, casting="unsafe")


class MXFP4PackedWeight(PackedWeight):
    """One mxfp4-pack-quantized linear: E2M1 codes, an E8M0 scale per row and 32 columns."""

    def __init__(self, stored: SafetensorsCheckpoint, module: str, fmt: SourceFormat):
        self.stored = stored
        packed, scale = module + PACKED, module + SCALE
        where = stored.file_of(packed)
        self.shape = _packed_shape(stored, packed)
        if scale not in stored:
            raise FormatError(f"{where}: {packed} is stored but {scale} is missing; a {fmt.name} checkpoint has a "
                              "scale beside every packed weight")
        expected = (self.shape[0], -(-self.shape[1] // 32))
        if stored.dtype(scale) != np.uint8 or tuple(stored.shape(scale)) != expected:
            raise FormatError(f"{stored.file_of(scale)}: {scale} is {stored.dtype(scale)} {list(stored.shape(scale))}, "
                              f"but the E8M0 scales of a {list(self.shape)} {fmt.name} weight are uint8 "
                              f"{list(expected)} (one per 32 columns)")
        self.parts = (packed, scale)

    def fill(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows [start, stop): E2M1 x 2^(byte - 127), rounded to out's dtype."""
        stored, (packed, scale) = self.stored, self.parts
        exponent = _e8m0_rows(stored, scale, start, stop)
        values = E2M1_VALUES[unpack_fp4(stored.get_rows(packed, start, stop))]
        values = np.ldexp(values, np.repeat(exponent, 32, axis=1)[:, :self.shape[1]])
        np.copyto(out, values, casting="unsafe")


def _e8m0_rows(stored: SafetensorsCheckpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of an E8M0 scale tensor as int32 exponents (byte - 127); InvalidCheckpointError for
    the NaN byte 255."""
    raw = stored.get_rows(name, start, stop)
    if (raw == 0xFF).any():
        raise InvalidCheckpointError(f"{stored.file_of(name)}: {name} holds scales that are not finite (NaN: E8M0 "
                                     "byte 255), so the MXFP4 weight they scale cannot be read; the checkpoint is "
                                     "corrupt")
    return raw.astype(np.int32) - E8M0_BIAS


class MXFP4BlocksWeight(PackedWeight):
    """One gpt-oss MXFP4 expert tensor: `_blocks` and `_scales` read as the float [experts, in, out] tensor."""

    def __init__(self, stored: SafetensorsCheckpoint, base: str):
        self.stored = stored
        blocks, scales = base + BLOCKS, base + SCALES
        where = stored.file_of(blocks)
        shape = tuple(stored.shape(blocks))
        if stored.dtype(blocks) != np.uint8 or len(shape) != 4 or shape[-1] != 16:
            raise FormatError(f"{where}: {blocks} is {stored.dtype(blocks)} {list(shape)}, not uint8 [experts, rows, "
                              "groups, 16] (32 E2M1 codes a group); the packing does not match the format")
        if scales not in stored:
            raise FormatError(f"{where}: {blocks} is stored but {scales} is missing; an MXFP4 checkpoint has the "
                              "scales beside every blocks tensor")
        if stored.dtype(scales) != np.uint8 or tuple(stored.shape(scales)) != shape[:3]:
            raise FormatError(f"{stored.file_of(scales)}: {scales} is {stored.dtype(scales)} "
                              f"{list(stored.shape(scales))}, but the E8M0 scales of {blocks} {list(shape)} are "
                              f"uint8 {list(shape[:3])} (one per group of 32)")
        experts, rows, groups, _ = shape
        self.shape = (experts, groups * 32, rows)
        self.parts = (blocks, scales)

    def fill(self, start: int, stop: int, out: np.ndarray) -> None:
        """Experts [start, stop): E2M1 x 2^(byte - 127), each expert's [rows, columns] transposed."""
        stored, (blocks, scales) = self.stored, self.parts
        experts, columns, rows = stop - start, self.shape[1], self.shape[2]
        exponent = _e8m0_rows(stored, scales, start, stop)
        codes = unpack_fp4(stored.get_rows(blocks, start, stop).reshape(experts * rows, -1))
        values = E2M1_VALUES[codes].reshape(experts, rows, columns // 32, 32)
        values = np.ldexp(values, exponent[..., None])
        np.copyto(out, values.reshape(experts, rows, columns).transpose(0, 2, 1), casting="unsafe")


def fp4_weights(stored: SafetensorsCheckpoint, fmt: SourceFormat) -> dict[str, PackedWeight]:
    """Every nvfp4- or mxfp4-pack-quantized linear of `stored`, by the name of the float weight it stands for."""
    return packed_weights(stored, fmt, MXFP4PackedWeight if fmt.power_of_two_scales else NVFP4Weight)


def mxfp4_weights(stored: SafetensorsCheckpoint, fmt: SourceFormat) -> dict[str, PackedWeight]:
    """Every MXFP4 blocks tensor of `stored`, by the name of the float tensor it stands for."""
    weights: dict[str, PackedWeight] = {}
    for name in stored.tensor_names:
        if name.endswith(BLOCKS):
            base = name[: -len(BLOCKS)]
            if base in stored:
                raise FormatError(f"{stored.file_of(name)}: {base} is stored both as float and as {name}")
            weights[base] = MXFP4BlocksWeight(stored, base)
    return weights
