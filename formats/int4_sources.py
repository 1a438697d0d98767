"""compressed-tensors `pack-quantized` int4 weights read as float, a block of rows at a time.

    <m>.weight_packed      int32 [out, ceil(in/8)]        u = q + 8, column 8k+j in bits 4j..4j+3 of word k
    <m>.weight_scale       float [out, ceil(in/group)]    ([out, 1] per channel, [1] per tensor)
    <m>.weight_zero_point  int32 [ceil(out/8), groups]     z + 8 packed along the output rows (asymmetric only)
    <m>.weight_shape       int [2] = (out, in)

value = (q - z) x scale, computed in float32 and rounded once to the checkpoint's dtype: compressed-tensors'
decompression multiplies in the scale's dtype (the model's), which for a bfloat16 or float16 scale is that
float32 product rounded once.

A PackedWeight is one such weight seen as a float tensor: its shape, the stored tensors it is read from, and
`fill`, which writes rows of the float weight into an array of the read dtype. The FP4 sources
(formats/fp4_sources.py) are PackedWeights too.
"""

from __future__ import annotations

import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.formats.layout_int4_asym import unpack_zero_points
from qconvert.formats.packing import unpack_int32_to_int4
from qconvert.formats.quantized_sources import (
    ACTIVATION_SCALE_SUFFIXES, SourceFormat, check_finite,
)
from qconvert.formats.safetensors_io import SafetensorsCheckpoint

PACKED, SCALE, ZERO_POINT, SHAPE = ".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape"
# Tensors of a quantized linear that no float model has besides its weight's own (activation scales).
EXTRA_SUFFIXES = (*ACTIVATION_SCALE_SUFFIXES, ".input_global_scale")


class PackedWeight:
    """A packed weight read as float: `shape` (the float tensor's), `parts` (the stored tensors it is read from,
    the first holding its codes) and `fill(start, stop, out)` (rows [start, stop) into `out`)."""

    shape: tuple[int, ...]
    parts: tuple[str, ...]

    def fill(self, start: int, stop: int, out: np.ndarray) -> None:
        raise NotImplementedError


def _float_dtype_names() -> tuple[np.dtype, ...]:
    import ml_dtypes

    return np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)


class Int4Weight(PackedWeight):
    """One pack-quantized linear: int4 codes, a scale per row and group (or row, or tensor), zero points when
    stored."""

    def __init__(self, stored: SafetensorsCheckpoint, module: str, fmt: SourceFormat):
        self.stored, self.module = stored, module
        where = stored.file_of(module + PACKED)
        self.shape = _weight_shape(stored, module, where)
        out_features, in_features = self.shape
        packed_shape, packed_dtype = tuple(stored.shape(module + PACKED)), stored.dtype(module + PACKED)
        if packed_dtype != np.int32 or packed_shape != (out_features, -(-in_features // 8)):
            raise FormatError(f"{where}: {module}{PACKED} is {packed_dtype} {list(packed_shape)}, but eight 4-bit "
                              f"codes to an int32 word of a {list(self.shape)} weight are int32 "
                              f"{[out_features, -(-in_features // 8)]}; the packing does not match the shape")
        grid = _scale_grid(stored, module, fmt, self.shape)
        self.per_tensor, self.group = grid.strategy == "tensor", grid.block_of(self.shape)[1]
        self.zero_point = _zero_point(stored, module, fmt, self.shape, -(-in_features // self.group),
                                      self.per_tensor)
        self.parts = (module + PACKED, module + SCALE, module + SHAPE) + ((module + ZERO_POINT,)
                                                                          if self.zero_point else ())

    def fill(self, start: int, stop: int, out: np.ndarray) -> None:
        """Rows [start, stop): (q - z) x scale in float32, rounded once to out's dtype."""
        stored, module = self.stored, self.module
        in_features = self.shape[1]
        codes = unpack_int32_to_int4(stored.get_rows(module + PACKED, start, stop), in_features)
        values = codes.astype(np.float32)
        if self.zero_point:
            first = start // 8
            zero = unpack_zero_points(stored.get_rows(module + ZERO_POINT, first, -(-stop // 8)),
                                      -(-stop // 8) * 8 - first * 8)[start - first * 8:stop - first * 8]
            values -= _by_column(zero.astype(np.float32), self.group, in_features)
        scale_name = module + SCALE
        if self.per_tensor:
            scale = stored.get(scale_name).reshape(1, 1)
        else:  # a scale per row and group (or row)
            scale = stored.get_rows(scale_name, start, stop)
        scale = check_finite(scale, f"{stored.file_of(scale_name)}: {scale_name}", "int4")
        values *= _by_column(scale, self.group, in_features)
        np.copyto(out, values, casting="unsafe")


def _by_column(per_group: np.ndarray, group: int, columns: int) -> np.ndarray:
    """[rows, groups] values spread over the columns each group covers (the last group possibly partial)."""
    if per_group.shape[1] == 1:
        return per_group
    return np.repeat(per_group, group, axis=1)[:, :columns]


def _weight_shape(stored: SafetensorsCheckpoint, module: str, where) -> tuple[int, int]:
    name = module + SHAPE
    if name not in stored:
        raise FormatError(f"{where}: {module}{PACKED} is stored but {name} is missing; a pack-quantized "
                          "checkpoint has the shape beside every packed weight")
    shape_dtype, shape_shape = stored.dtype(name), tuple(stored.shape(name))
    values = stored.get(name).reshape(-1) if shape_shape == (2,) and shape_dtype.kind in "iu" else None
    if values is None or not all(v > 0 for v in values.tolist()):
        shown = values.tolist() if values is not None else f"{shape_dtype} {list(shape_shape)}"
        raise FormatError(f"{stored.file_of(name)}: {name} is {shown}, not two positive integers [out, in]")
    return int(values[0]), int(values[1])


def _scale_grid(stored: SafetensorsCheckpoint, module: str, fmt: SourceFormat, shape: tuple[int, int]):
    """The ScaleGrid of the module's scales; FormatError when the scale is missing or its shape or dtype is not
    one the config allows."""
    name = module + SCALE
    if name not in stored:
        raise FormatError(f"{stored.file_of(module + PACKED)}: {module}{PACKED} is stored but {name} is missing; "
                          f"a {fmt.name} checkpoint has a scale beside every packed weight")
    scale_shape = tuple(stored.shape(name))
    grid = fmt.grid_for(shape, scale_shape)
    if grid is None:
        raise FormatError(f"{stored.file_of(name)}: {name} has shape {list(scale_shape)}, but a {fmt.name} scale "
                          f"of a {list(shape)} weight is {fmt.expected_scale_shapes(shape)}")
    if stored.dtype(name) not in _float_dtype_names():
        raise FormatError(f"{stored.file_of(name)}: {name} is {stored.dtype(name)}, not a float32, bfloat16 or "
                          "float16 scale")
    return grid


def _zero_point(stored: SafetensorsCheckpoint, module: str, fmt: SourceFormat, shape: tuple[int, int],
                groups: int, per_tensor: bool) -> bool:
    """Whether the module has zero points; FormatError when their presence or shape contradicts the config."""
    name = module + ZERO_POINT
    where = stored.file_of(module + PACKED)
    if name not in stored:
        if fmt.symmetric is False:
            raise FormatError(f"{where}: {name} is missing, but config.json's quantization_config says every "
                              "group's weights are asymmetric (symmetric: false)")
        return False
    if fmt.symmetric is True or per_tensor:
        raise FormatError(f"{stored.file_of(name)}: {name} is stored, but config.json's quantization_config says "
                          f"{module}'s weights are symmetric; the checkpoint is inconsistent")
    expected = (-(-shape[0] // 8), groups)
    if stored.dtype(name) != np.int32 or tuple(stored.shape(name)) != expected:
        raise FormatError(f"{stored.file_of(name)}: {name} is {stored.dtype(name)} {list(stored.shape(name))}, "
                          f"but the zero points of a {list(shape)} weight in {groups} group(s), packed eight to "
                          f"an int32 word along the rows, are int32 {list(expected)}")
    return True


def packed_weights(stored: SafetensorsCheckpoint, fmt: SourceFormat, kind) -> dict[str, PackedWeight]:
    """Every linear of `stored` stored as `<m>.weight_packed`, as `kind(stored, module, fmt)`, by the name of the
    float weight it stands for; FormatError for a linear stored both packed and as float."""
    weights: dict[str, PackedWeight] = {}
    for name in stored.tensor_names:
        if name.endswith(PACKED):
            module = name[: -len(PACKED)]
            if module + ".weight" in stored:
                raise FormatError(f"{stored.file_of(name)}: {module} has both a float weight and {name}")
            weights[module + ".weight"] = kind(stored, module, fmt)
    return weights


def int4_weights(stored: SafetensorsCheckpoint, fmt: SourceFormat) -> dict[str, PackedWeight]:
    """Every pack-quantized linear of `stored`, by the name of the float weight it stands for."""
    return packed_weights(stored, fmt, Int4Weight)


def check_claimed(stored: SafetensorsCheckpoint, fmt: SourceFormat, weights: dict[str, PackedWeight],
                  suffixes: tuple[str, ...]) -> frozenset[str]:
    """The stored tensors the float view hides (each weight's parts, its linear's activation scales); FormatError
    when the checkpoint has no weight in `fmt` (a config claiming a format its tensors do not have) or a tensor
    with one of `suffixes` that belongs to no packed weight."""
    if not weights:
        raise FormatError(f"{stored.folder}: config.json's quantization_config says {fmt.name}, but no tensor is "
                          "stored in that format; the checkpoint is inconsistent")
    hidden = {part for weight in weights.values() for part in weight.parts}
    modules = {weight.parts[0].rsplit(".", 1)[0] for weight in weights.values()}
    hidden |= {m + s for m in modules for s in EXTRA_SUFFIXES if m + s in stored}
    for name in stored.tensor_names:
        if name not in hidden and name.endswith(suffixes):
            raise FormatError(f"{stored.file_of(name)}: {name} belongs to a packed weight that is not stored; the "
                              f"{fmt.name} checkpoint is incomplete")
    return frozenset(hidden)

