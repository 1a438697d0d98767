"""The fold every smoothing-like step shares: a group's per-channel scales folded into its source and its linears.

A smoothing group (a norm, or a linear whose output feeds some linears) gets scales s: the source divides its
output channels by s, the linears multiply their input columns by s, so the float model computes the same
function while the linears see X / s. SmoothQuant and AWQ choose s differently (methods/smoothquant.py,
methods/awq.py) and fold it alike, here; `Results.folds()` hands the writer what every tensor becomes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.models.family import SmoothingGroup

MIN_SCALE = 1e-5  # the least s a source divides by


def channel_map(group: SmoothingGroup, in_features: int) -> np.ndarray:
    """For each input channel of the group's linears, the source channel that feeds it (int64 [in])."""
    i = np.arange(in_features)
    if group.head_dim <= 0 or (group.kv_repeat <= 1 and not group.source_stride):
        return i
    stride = group.source_stride or group.head_dim
    return ((i // group.head_dim) // max(group.kv_repeat, 1)) * stride + i % group.head_dim


def source_scales(s: np.ndarray, index: np.ndarray) -> np.ndarray:
    """s per source channel, 1 where no input channel reads the source channel (a strided source's gaps)."""
    read = np.zeros(len(s), bool)
    read[index] = True
    return s if read.all() else np.where(read, s, np.float32(1)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class GroupScales:
    """One group's smoothing: s per source channel and per consumer input channel."""

    group: SmoothingGroup
    alpha: float
    source_scales: np.ndarray  # float32 [source channels]: the source divides by these
    input_scales: np.ndarray   # float32 [in]: consumer columns multiply by these


# A folded gain stored as an offset from 1 (Gemma) keeps at least this many steps of its dtype above 0.
MIN_GAIN_STEPS = 4


def stored_gain_scales(scales: GroupScales, norm_weight: np.ndarray) -> GroupScales:
    """A norm group whose gain is stored as an offset (Gemma: 1 + w), with the s the stored gain carries.

    The folded w' = (1 + w) / s - 1 lies near -1 when s is large, where bf16 has
    steps of 2^-8: the gain 1 + w' the norm then applies is off by up to 2^-9
    absolute, about s * 2^-9 of (1 + w) / s. So the fold is done in float32 as
    `apply_fold` does it, the stored value rounded to the norm's dtype, and the
    consumers' columns multiply by what the stored gain really divided by,
    (1 + w) / (1 + w'), instead of s: the smoothed float model then computes the
    source's function up to float32 rounding. s is first capped where the stored
    gain would keep fewer than MIN_GAIN_STEPS steps of the dtype (it would round
    to 0, or to a handful of values).
    """
    offset = np.float32(scales.group.norm_offset)
    if not offset:
        return scales
    dtype = np.asarray(norm_weight).dtype
    gain = np.asarray(norm_weight).astype(np.float32) + offset
    step = np.float32(jnp.finfo(dtype).eps) * abs(offset) / 2  # the dtype's spacing just inside -offset
    s = scales.source_scales.astype(np.float32)
    ceiling = np.where(gain != 0, np.abs(gain) / (MIN_GAIN_STEPS * step), np.inf).astype(np.float32)
    s = np.maximum(np.minimum(s, ceiling), np.float32(MIN_SCALE))
    stored = ((gain / s - offset).astype(dtype).astype(np.float32) + offset)
    carried = np.where((stored != 0) & (np.sign(stored) == np.sign(gain)), gain / np.where(stored != 0, stored, 1),
                       s).astype(np.float32)
    index = channel_map(scales.group, len(scales.input_scales))
    return dataclasses.replace(scales, source_scales=s, input_scales=carried[index])


@dataclasses.dataclass(frozen=True)
class TensorFold:
    """What smoothing does to one checkpoint tensor: w * col_multiplier[None, :] / row_divisor[:, None]."""

    row_divisor: np.ndarray | None = None     # the rows (or a 1-D tensor) divide by this
    col_multiplier: np.ndarray | None = None  # the columns multiply by this
    row_offset: int = 0                       # row_divisor[c] divides row row_offset + c
    # A norm gain stored as an offset from 1 (Gemma): (offset + w) / s - offset, so the
    # gain the norm applies, offset + w, is what divides by s.
    gain_offset: float = 0.0


def tensor_folds(scales: Sequence[GroupScales]) -> dict[str, TensorFold]:
    """Tensor name -> TensorFold for every tensor the groups touch (a tensor may get rows and columns)."""
    rows: dict[str, tuple[np.ndarray, int]] = {}
    cols: dict[str, np.ndarray] = {}
    offsets: dict[str, float] = {}
    for g in scales:
        source = g.group.source
        rows[f"{source}.weight"] = (g.source_scales, g.group.source_offset)
        offsets[f"{source}.weight"] = float(g.group.norm_offset)
        # LayerNorm / linear bias; absent tensors never ask
        rows[f"{source}.bias"] = (g.source_scales, g.group.source_offset)
        for linear in g.group.linears:
            name = f"{linear}.weight"
            if name in cols:
                raise ValueError(f"{linear} belongs to two smoothing groups")
            cols[name] = g.input_scales
    folds = {}
    for name in sorted(set(rows) | set(cols)):
        divisor, offset = rows.get(name, (None, 0))
        folds[name] = TensorFold(divisor, cols.get(name), offset, offsets.get(name, 0.0))
    return folds


def apply_fold(array: np.ndarray, fold: TensorFold, name: str | None = None) -> np.ndarray:
    """The smoothed tensor, computed in float32 and cast back to the tensor's dtype.

    UsageError, naming the tensor (`name`), when the smoothing takes finite values beyond what that dtype holds
    (float16 tops out at 65504): the source is fine, the scales are too large for it.
    """
    out = np.asarray(array).astype(np.float32)
    if fold.col_multiplier is not None:
        out = out * fold.col_multiplier[None, :]
    if fold.row_divisor is not None:
        rows = slice(fold.row_offset, fold.row_offset + len(fold.row_divisor))
        divisor = fold.row_divisor if out.ndim == 1 else fold.row_divisor[:, None]
        if fold.gain_offset:
            gain = np.float32(fold.gain_offset)
            out[rows] = (out[rows] + gain) / divisor - gain
        else:
            out[rows] = out[rows] / divisor
    dtype = np.asarray(array).dtype
    with np.errstate(over="ignore"):  # an overflow is checked for just below
        smoothed = out.astype(dtype)
    # Only a dtype whose range is below float32's (float16, bfloat16) can overflow where float32 did not.
    if ml_dtypes.finfo(dtype).max < np.finfo(np.float32).max and not np.all(np.isfinite(smoothed)):
        _check_fold_fits(out, dtype, name)
    return smoothed


def _check_fold_fits(smoothed: np.ndarray, dtype: np.dtype, name: str | None) -> None:
    """UsageError when float32 values the smoothing gave are finite but overflow `dtype` (non-finite values
    that were there before smoothing are the checkpoint's, and the writer's NaN check names them)."""
    finite = np.isfinite(smoothed)
    largest = float(np.max(np.abs(smoothed[finite]))) if finite.any() else 0.0
    if finite.all() and largest > float(ml_dtypes.finfo(dtype).max):
        raise UsageError(f"{name or 'a tensor'}: SmoothQuant's scales (--alpha) make it {largest:.3g} in magnitude, "
                         f"beyond {dtype.name}'s largest {float(ml_dtypes.finfo(dtype).max):.6g}; give a smaller --alpha "
                         "(for its group alone: --alpha GROUP=VALUE), or convert a float32 copy of the model")
