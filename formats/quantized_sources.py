"""The quantized checkpoints qconvert reads as float: their quantization_config, their scale grids, and the one
dequantization rule w = fp8 x scale.

    DeepSeek style block FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3 -FP8):
        quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}
        <m>.weight            float8_e4m3fn [out, in]
        <m>.weight_scale_inv  float32 [ceil(out/128), ceil(in/128)]  (or float8_e8m0fnu: power-of-two scales)
    compressed-tensors float-quantized (FP8, FP8_DYNAMIC, FP8_BLOCK):
        quantization_config {"quant_method": "compressed-tensors", "format": "float-quantized", ...}
        <m>.weight            float8_e4m3fn [out, in]
        <m>.weight_scale      [1] per tensor, [out, 1] per channel, [ceil(out/b0), ceil(in/b1)] per block
        <m>.input_scale       static activations only: not part of the weights, hidden
    compressed-tensors pack-quantized int4 (W4A16, W4A16_ASYM; formats/int4_sources.py):
        <m>.weight_packed int32 [out, ceil(in/8)], <m>.weight_scale [out, groups], <m>.weight_shape,
        <m>.weight_zero_point int32 [ceil(out/8), groups] (asymmetric only)
    compressed-tensors nvfp4- and mxfp4-pack-quantized and gpt-oss's MXFP4 (quant_method "mxfp4";
    formats/fp4_sources.py)

The 4-bit sources are read as (q - zero point) x scale computed in float32 and rounded once to the checkpoint's
own dtype (config.json's torch_dtype), as compressed-tensors' and transformers' decompression compute them.

Every FP8 scale covers a block of rows x columns of the weight (a channel: 1 x in; the tensor: out x in), the
blocks at the right and bottom edges partial. The dequantized value is the float32 product fp8 x scale rounded
once to bfloat16, as DeepSeek's own fp8_cast_bf16 (its weight_dequant kernel) computes it; compressed-tensors'
decompression (fp8 cast to the scale's dtype, times the scale) gives the same bfloat16 values for bfloat16
scales (an e4m3 x bf16 product is exact in float32) and, for float32 scales, the same float32 product.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from qconvert.formats.errors import InvalidCheckpointError

FP8_WEIGHT_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
# The dtype a quantized source's weights are read as: the models these formats ship were trained and released
# in bfloat16, and bfloat16 is what DeepSeek's own fp8-to-bf16 cast writes.
DEQUANTIZED_DTYPE = np.dtype(ml_dtypes.bfloat16)
# Every e4m3 code's value, by its byte (a lookup widens codes to float32 twice as fast as a cast).
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FP8_WEIGHT_DTYPE).astype(np.float32)
SCALE_DTYPES = tuple(np.dtype(d) for d in (np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e8m0fnu))
# Tensors of a quantized linear besides its weight that no float model has: hidden with the linear's scales.
ACTIVATION_SCALE_SUFFIXES = (".input_scale",)

READS = ("block FP8 (quant_method 'fp8' with weight_block_size, e4m3 weights), compressed-tensors "
         "float-quantized FP8 (per tensor, channel or block), compressed-tensors pack-quantized int4 (per group or "
         "channel, with or without zero points), nvfp4- and mxfp4-pack-quantized and gpt-oss's MXFP4 as float")
FP8, INT_PACKED, NVFP4, MXFP4_PACKED, MXFP4_BLOCKS = "fp8", "int-packed", "nvfp4", "mxfp4-packed", "mxfp4-blocks"
# The dtypes config.json's torch_dtype may name for a 4-bit source's dequantized weights.
FLOAT_DTYPES_BY_NAME = {"bfloat16": DEQUANTIZED_DTYPE, "float16": np.dtype(np.float16),
                        "float32": np.dtype(np.float32)}


def read_as(format_name: str) -> str:
    """How a source of the recorded format `format_name` was read, for the card and inspect."""
    if format_name.startswith(("fp8-", "compressed-tensors-fp8-")):
        return "its fp8 weights read as bfloat16"
    return "its 4-bit weights read as float, in its own dtype"


class NotReadable(ValueError):
    """A quantization_config qconvert does not read as float; the message says what it is."""


@dataclasses.dataclass(frozen=True)
class ScaleGrid:
    """How one strategy's scale tensor covers the weight: `block` rows x columns per scale (None: the whole
    dimension, as per channel's columns and per tensor's rows and columns)."""

    strategy: str  # "block", "channel" or "tensor"
    block: tuple[int | None, int | None]

    def block_of(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The rows x columns one scale covers in a weight of `shape`."""
        return tuple(b if b is not None else max(1, d) for b, d in zip(self.block, shape))

    def fits(self, weight_shape: tuple[int, int], scale_shape: tuple[int, ...]) -> bool:
        """Whether a scale tensor of `scale_shape` is this strategy's for a weight of `weight_shape`."""
        if self.strategy == "tensor":
            return math.prod(scale_shape) == 1 and len(scale_shape) <= 2
        rows, cols = self.block_of(weight_shape)
        return tuple(scale_shape) == (-(-weight_shape[0] // rows), -(-weight_shape[1] // cols))


BLOCK = "block"
CHANNEL = ScaleGrid("channel", (1, None))
TENSOR = ScaleGrid("tensor", (None, None))


@dataclasses.dataclass(frozen=True)
class SourceFormat:
    """A quantized source format qconvert reads as float: its name (recorded in qconvert.json), the suffix of its
    weight scales, the scale grids its config allows, whether its scales must be powers of two, its kind (how
    its weights are stored) and, for packed int weights, whether they have zero points."""

    name: str  # e.g. "fp8-block-128x128", "compressed-tensors-fp8-channel"
    scale_suffix: str  # ".weight_scale_inv" (DeepSeek style) or ".weight_scale" (compressed-tensors)
    grids: tuple[ScaleGrid, ...]
    power_of_two_scales: bool = False  # DeepSeek's "scale_fmt": "ue8m0"
    kind: str = FP8  # FP8, INT_PACKED, NVFP4, MXFP4_PACKED or MXFP4_BLOCKS
    symmetric: bool | None = True  # INT_PACKED: True none has zero points, False all have, None some groups

    def grid_for(self, weight_shape: tuple[int, int], scale_shape: tuple[int, ...]) -> ScaleGrid | None:
        """The grid a scale tensor's shape says, among those the config allows (None: it fits none)."""
        return next((g for g in self.grids if g.fits(weight_shape, scale_shape)), None)

    def expected_scale_shapes(self, weight_shape: tuple[int, int]) -> str:
        """The scale shapes the config allows for a weight, for a message."""
        shapes = []
        for grid in self.grids:
            if grid.strategy == "tensor":
                shapes.append("[1]")
            else:
                rows, cols = grid.block_of(weight_shape)
                shapes.append(str([-(-weight_shape[0] // rows), -(-weight_shape[1] // cols)]))
        return " or ".join(shapes)


def source_format(qconfig: Any) -> SourceFormat | None:
    """The format of a checkpoint whose config.json has `qconfig` as its quantization_config (None when it has
    none: a float checkpoint). NotReadable, saying what the config describes, for a quantization qconvert does
    not read as float; InvalidCheckpointError for a value of the wrong kind in one it does."""
    if qconfig is None:
        return None
    if not isinstance(qconfig, dict):
        raise NotReadable("a quantization_config that is not an object")
    method = qconfig.get("quant_method")
    if method == "fp8":
        return _deepseek_format(qconfig)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qconfig)
    if method == "mxfp4":
        return SourceFormat("gpt-oss-mxfp4", "_scales", (), power_of_two_scales=True, kind=MXFP4_BLOCKS)
    raise NotReadable(f"quant_method {method!r}" if isinstance(method, str) else "no quant_method")


def _deepseek_format(qconfig: dict) -> SourceFormat:
    fmt = qconfig.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NotReadable(f"quant_method 'fp8', fmt {fmt!r}")
    block = qconfig.get("weight_block_size")
    if block is None:
        raise NotReadable("quant_method 'fp8' without weight_block_size (per-tensor FP8)")
    rows, cols = _block_size(block, "weight_block_size")
    scale_fmt = qconfig.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise NotReadable(f"quant_method 'fp8', scale_fmt {scale_fmt!r}")
    return SourceFormat(f"fp8-block-{rows}x{cols}" + ("-ue8m0" if scale_fmt else ""), ".weight_scale_inv",
                        (ScaleGrid(BLOCK, (rows, cols)),), power_of_two_scales=scale_fmt == "ue8m0")


def _compressed_tensors_format(qconfig: dict) -> SourceFormat:
    groups = qconfig.get("config_groups")
    formats = {g.get("format") or qconfig.get("format") for g in groups.values() if isinstance(g, dict)} \
        if isinstance(groups, dict) else set()
    fmt = formats.pop() if len(formats) == 1 else qconfig.get("format")
    what = f"quant_method 'compressed-tensors', format {fmt!r}"
    if formats or fmt not in ("float-quantized", "pack-quantized", "nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        raise NotReadable(what if not formats else f"{what} mixed with {sorted(map(str, formats))}")
    status = qconfig.get("quantization_status", "compressed")
    if status != "compressed":
        raise NotReadable(f"{what}, quantization_status {status!r} (weights not stored compressed)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qconfig.get(key):
            raise NotReadable(f"{what} with a {key}")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise InvalidCheckpointError("config.json: quantization_config has no config_groups of objects")
    if fmt == "pack-quantized":
        return _int_packed_format(groups, what)
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return _fp4_format(groups, what, 16 if fmt.startswith("nvfp4") else 32)
    grids: list[ScaleGrid] = []
    for name, group in sorted(groups.items()):
        grid = _group_grid(name, group.get("weights"), what)
        if grid not in grids:
            grids.append(grid)
    names = sorted(g.strategy if g.strategy != BLOCK else f"block-{g.block[0]}x{g.block[1]}" for g in grids)
    return SourceFormat("compressed-tensors-fp8-" + "+".join(names), ".weight_scale", tuple(grids))


def _weights_of(name: str, group: dict, what: str) -> dict:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise NotReadable(f"{what}, group {name} without quantized weights")
    return weights


def _int_packed_format(groups: dict, what: str) -> SourceFormat:
    """pack-quantized: static 4-bit int weights per group, channel or tensor, each group symmetric or not."""
    grids: list[ScaleGrid] = []
    symmetric = set()
    for name, group in sorted(groups.items()):
        weights = _weights_of(name, group, what)
        settings = {k: weights.get(k) for k in ("num_bits", "type", "strategy", "symmetric", "actorder")}
        strategy = weights.get("strategy")
        if (weights.get("num_bits"), weights.get("type", "int")) != (4, "int") \
                or weights.get("dynamic", False) is not False or strategy not in ("group", "channel", "tensor") \
                or weights.get("actorder") not in (None, "weight", "static") \
                or strategy == "tensor" and weights.get("symmetric", True) is not True:
            raise NotReadable(f"{what}, group {name} weights {settings} (qconvert reads static 4-bit int weights "
                              "per group or channel, with or without zero points, and symmetric per tensor)")
        grid = CHANNEL if strategy == "channel" else TENSOR if strategy == "tensor" else \
            ScaleGrid("group", (1, _positive_int(weights.get("group_size"), f"group {name} group_size")))
        grids += [grid] if grid not in grids else []
        symmetric.add(weights.get("symmetric", True) is not False)
    names = sorted(g.strategy if g.strategy != "group" else f"group-{g.block[1]}" for g in grids)
    sym = symmetric.pop() if len(symmetric) == 1 else None
    return SourceFormat("compressed-tensors-int4-" + ("" if sym else "asym-") + "+".join(names), ".weight_scale",
                        tuple(grids), kind=INT_PACKED, symmetric=sym)


def _fp4_format(groups: dict, what: str, group_size: int) -> SourceFormat:
    """nvfp4-pack-quantized (E2M1 in groups of 16 under a global scale) or mxfp4-pack-quantized (groups of 32,
    E8M0 scales): symmetric static E2M1 weights."""
    for name, group in sorted(groups.items()):
        weights = _weights_of(name, group, what)
        settings = {k: weights.get(k) for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}
        if (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", group_size) \
                or weights.get("strategy") not in ("tensor_group", "group") \
                or weights.get("symmetric", True) is not True or weights.get("dynamic", False) is not False:
            raise NotReadable(f"{what}, group {name} weights {settings} (not symmetric E2M1 in groups of "
                              f"{group_size})")
    if group_size == 16:
        return SourceFormat("compressed-tensors-nvfp4", ".weight_scale", (ScaleGrid("group", (1, 16)),), kind=NVFP4)
    return SourceFormat("compressed-tensors-mxfp4", ".weight_scale", (ScaleGrid("group", (1, 32)),),
                        power_of_two_scales=True, kind=MXFP4_PACKED)


def _positive_int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidCheckpointError(f"config.json: quantization_config {key} is {value!r}, not a positive integer")
    return value


def dequantized_dtype(fmt: SourceFormat, config: dict) -> np.dtype:
    """The dtype `fmt`'s weights are read as: bfloat16 for the FP8 sources (what their releases were made from),
    config.json's torch_dtype (or dtype) for the 4-bit ones, bfloat16 where it names none."""
    if fmt.kind == FP8:
        return DEQUANTIZED_DTYPE
    key = "torch_dtype" if "torch_dtype" in config else "dtype"
    declared = config.get(key)
    if declared is None:
        return DEQUANTIZED_DTYPE
    if declared not in FLOAT_DTYPES_BY_NAME:
        raise InvalidCheckpointError(f"config.json: {key} is {declared!r}; a {fmt.name} checkpoint is read as "
                                     "one of " + ", ".join(FLOAT_DTYPES_BY_NAME))
    return FLOAT_DTYPES_BY_NAME[declared]


def _group_grid(name: str, weights: Any, what: str) -> ScaleGrid:
    """The scale grid of one config group's weights: symmetric 8-bit float (e4m3) per tensor, channel or block."""
    if not isinstance(weights, dict):
        raise NotReadable(f"{what}, group {name} without quantized weights")
    settings = {k: weights.get(k) for k in ("num_bits", "type", "strategy")}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float") or weights.get("symmetric", True) is not True \
            or weights.get("dynamic", False) is not False:
        raise NotReadable(f"{what}, group {name} weights {settings} (not symmetric static 8-bit float)")
    strategy = weights.get("strategy")
    if strategy == "channel":
        return CHANNEL
    if strategy == "tensor":
        return TENSOR
    if strategy == BLOCK:
        return ScaleGrid(BLOCK, _block_size(weights.get("block_structure"), f"group {name} block_structure"))
    raise NotReadable(f"{what}, group {name} weights {settings}")


def _block_size(value: Any, key: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise InvalidCheckpointError(f"config.json: quantization_config {key} is {value!r}, not two positive "
                                     "integers (rows, columns)")
    return int(value[0]), int(value[1])


def scale_as_float32(scale: np.ndarray) -> np.ndarray:
    """Scale values as float32: exact for float32, bfloat16, float16 and float8_e8m0fnu (2^(e-127)) alike."""
    return np.asarray(scale).astype(np.float32)


def dequantize_rows(codes: np.ndarray, row_scales: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows of an fp8 weight with one scale per row (per channel) into bfloat16 `out`: each code times its
    row's scale in float32, rounded once to bfloat16. `codes` float8_e4m3fn [rows, in]; `row_scales` float32
    [rows, 1]."""
    values = _E4M3_VALUES[np.ascontiguousarray(codes).view(np.uint8)]
    values *= row_scales
    np.copyto(out, values, casting="unsafe")
    return out


def dequantize_block_rows(codes: np.ndarray, scales: np.ndarray, block_cols: int, out: np.ndarray) -> np.ndarray:
    """Rows of an fp8 weight that lie in one row of blocks into bfloat16 `out`: each code times its column
    block's scale in float32, rounded once to bfloat16. `codes` float8_e4m3fn [rows, in]; `scales` float32
    [ceil(in / block_cols)], the last column block possibly partial.

    Each block's 256 possible products are computed once (the same float32 multiply, the same rounding) and
    the codes index them: the rows go straight to bfloat16, with no float32 copy of the weight.
    """
    tables = (_E4M3_VALUES[None, :] * scales[:, None]).astype(DEQUANTIZED_DTYPE)
    raw = np.ascontiguousarray(codes).view(np.uint8)
    for j, table in enumerate(tables):
        columns = slice(j * block_cols, (j + 1) * block_cols)
        np.take(table, raw[:, columns], out=out[:, columns])
    return out


def check_finite(scale: np.ndarray, where: str, weight: str = "fp8") -> np.ndarray:
    """The scales as float32 (scale_as_float32); InvalidCheckpointError naming `where` (the file and the scale
    tensor) when one is NaN or infinite, checked before any product so that no weight is blamed for it."""
    values = scale_as_float32(scale)
    if not np.isfinite(values).all():
        kinds = " and ".join(k for k, bad in (("NaN", np.isnan(values).any()), ("infinite", np.isinf(values).any()))
                             if bad)
        raise InvalidCheckpointError(f"{where} holds scales that are not finite ({kinds}), so the {weight} weight "
                                     "they scale cannot be read; the checkpoint is corrupt")
    return values


def check_power_of_two(scale: np.ndarray, where: str) -> None:
    """InvalidCheckpointError unless every scale is a positive power of two (a ue8m0 config's promise)."""
    values = scale_as_float32(scale)
    mantissa, _ = np.frexp(values)
    if not (np.all(values > 0) and np.all(mantissa == 0.5)):
        raise InvalidCheckpointError(f"{where} holds scales that are not powers of two, but config.json's "
                                     "quantization_config says scale_fmt 'ue8m0'; the checkpoint is inconsistent")
