"""SmoothQuant: per-channel smoothing scales from activation and weight maxima, folded into norms and linears.

For a group (a norm or a linear whose output feeds some linears), input channel j
gets s_j = max|X_j|^a / max|W_j|^(1-a) (float32, both maxima and s clamped at
>= 1e-5; max|W_j| is the element-wise max over the group's linears). X / s is
what the linears then see, W * s their weights: the float product is unchanged,
while the activation outliers move into the weights, where per-channel int8
takes them easily. 1/s is folded into the source: a norm's weight (and
LayerNorm bias), or a source linear's output rows (and bias).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.qarray import INT8_QMAX
from qconvert.formats.quotient import int8_round
from qconvert.models.family import SmoothingGroup

MIN_SCALE = 1e-5
ALPHA_GRID = tuple(round(0.05 * k, 2) for k in range(21))
_HI = jax.lax.Precision.HIGHEST


def channel_map(group: SmoothingGroup, in_features: int) -> np.ndarray:
    """For each input channel of the group's linears, the source channel that feeds it (int64 [in])."""
    i = np.arange(in_features)
    if group.head_dim <= 0 or (group.kv_repeat <= 1 and not group.source_stride):
        return i
    stride = group.source_stride or group.head_dim
    return ((i // group.head_dim) // max(group.kv_repeat, 1)) * stride + i % group.head_dim


def _source_scales(s: np.ndarray, index: np.ndarray) -> np.ndarray:
    """s per source channel, 1 where no input channel reads the source channel (a strided source's gaps)."""
    read = np.zeros(len(s), bool)
    read[index] = True
    return s if read.all() else np.where(read, s, np.float32(1)).astype(np.float32)


def reduce_to_source(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Max of `values` over the consumer channels that share each source channel (float32)."""
    out = np.zeros(int(index.max()) + 1, np.float32)
    np.maximum.at(out, index, np.asarray(values, np.float32))
    return out


def weight_absmax(weights: Sequence[np.ndarray]) -> np.ndarray:
    """Per input column: max|W| over all rows of all the given [out, in] weights (float32 [in])."""
    return np.max(np.stack([np.max(np.abs(np.asarray(w, np.float32)), axis=0) for w in weights]), axis=0)


def smooth_scales(act_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float,
                  min_scale: float = MIN_SCALE) -> np.ndarray:
    """s = max|X|^alpha / max|W|^(1 - alpha), float32, clamped at >= min_scale."""
    act = np.maximum(np.asarray(act_absmax, np.float32), np.float32(min_scale))
    wmax = np.maximum(np.asarray(w_absmax, np.float32), np.float32(min_scale))
    s = np.power(act, np.float32(alpha)) / np.power(wmax, np.float32(1.0 - alpha))
    return np.maximum(s, np.float32(min_scale)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class GroupScales:
    """One group's smoothing: s per source channel and per consumer input channel."""

    group: SmoothingGroup
    alpha: float
    source_scales: np.ndarray  # float32 [source channels]: the source divides by these
    input_scales: np.ndarray   # float32 [in]: consumer columns multiply by these


def group_scales(group: SmoothingGroup, act_absmax: np.ndarray, weights: Sequence[np.ndarray],
                 alpha: float) -> GroupScales:
    """Smoothing scales of one group from its input's act_absmax [in] and its linears' weights."""
    index = channel_map(group, len(act_absmax))
    src_act = reduce_to_source(act_absmax, index)
    src_w = reduce_to_source(weight_absmax(weights), index)
    s = _source_scales(smooth_scales(src_act, src_w, alpha), index)
    return GroupScales(group, float(alpha), s, s[index])


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


def smoothed_input_absmax(act_absmax: np.ndarray, input_scales: np.ndarray | None) -> float:
    """max|X / s| over the whole tensor, from the per-channel maxima (exact: max is per channel)."""
    act = np.asarray(act_absmax, np.float32)
    if input_scales is not None:
        act = act / input_scales
    return float(np.max(act))


def read_group_weights(params: Mapping, group: SmoothingGroup) -> list[np.ndarray]:
    """The float32 weights [out, in] of a group's linears, read from a (lazy) params Mapping."""
    return [np.asarray(params[f"{linear}.weight"], np.float32) for linear in group.linears]


# -- --alpha auto --------------------------------------------------------------

def simulated_int8_rows(x: jax.Array) -> jax.Array:
    """The alpha search's model of W8A8 rounding: symmetric int8 per row, dequantized back to float32.

    Per output channel of a weight, per token of an activation. It rounds as the
    kernels' row quantizer does (`int8_round`, on the exact quotient); only its
    scale differs from kernels.activations.quantize_activations (max|x| / 127 as
    XLA computes it, floored at 1e-12, where the kernels give a zero row scale 1).
    """
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / INT8_QMAX, 1e-12)
    return int8_round(x, scale) * scale


@functools.partial(jax.jit, static_argnames=("linears",))
def _w8a8_errors(x: jax.Array, w: jax.Array, segment: jax.Array, s: jax.Array, static_scale: jax.Array,
                 linears: int) -> jax.Array:
    """[alphas, linears] relative squared error of simulated W8A8 (X/s)(W*s)^T against X W^T.

    w [sum of outs, in] stacks the group's linears, `segment` says which linear
    each row belongs to; s [alphas, in] holds every candidate's smoothing scales,
    static_scale [alphas] the per-tensor activation scale (0: per token). The
    whole grid is one computation: lax.map runs the alphas in one compiled loop,
    so the float reference and the weights are read once, not once per alpha.
    """
    y = jnp.matmul(x, w.T, precision=_HI)
    ref = jax.ops.segment_sum(jnp.sum(y * y, axis=0), segment, num_segments=linears)

    def one(args):
        s_a, static = args
        xs = x / s_a
        x_static = int8_round(xs, jnp.maximum(static, 1e-12)) * static
        xq = jnp.where(static > 0, x_static, simulated_int8_rows(xs))
        yq = jnp.matmul(xq, simulated_int8_rows(w * s_a[None, :]).T, precision=_HI)
        err = jax.ops.segment_sum(jnp.sum((yq - y) ** 2, axis=0), segment, num_segments=linears)
        return err / jnp.maximum(ref, 1e-30)

    return jax.lax.map(one, (s, static_scale))


def search_alpha(group: SmoothingGroup, act_absmax: np.ndarray, weights: Sequence[np.ndarray],
                 x_sample: np.ndarray, *, static: bool, grid: Sequence[float] = ALPHA_GRID,
                 ) -> tuple[GroupScales, dict[float, float]]:
    """The grid alpha whose smoothing gives the group's linears the least W8A8 output error on x_sample.

    The error of an alpha is the mean over the group's linears of the relative
    squared output error; all alphas run in one batched computation. Returns the
    chosen GroupScales and the error of every alpha tried (ties go to the smaller alpha).
    """
    # The maxima are the same for every alpha: reduce them once.
    index = channel_map(group, len(act_absmax))
    src_act, src_w = reduce_to_source(act_absmax, index), reduce_to_source(weight_absmax(weights), index)
    candidates = []
    for alpha in grid:
        s_alpha = _source_scales(smooth_scales(src_act, src_w, alpha), index)
        candidates.append(GroupScales(group, float(alpha), s_alpha, s_alpha[index]))
    s = np.stack([c.input_scales for c in candidates])
    static_scale = np.asarray([smoothed_input_absmax(act_absmax, c.input_scales) / INT8_QMAX if static else 0.0
                               for c in candidates], np.float32)
    w = np.concatenate([np.asarray(w, np.float32) for w in weights])
    segment = np.concatenate([np.full(len(w), i, np.int32) for i, w in enumerate(weights)])
    errors = np.asarray(_w8a8_errors(jnp.asarray(x_sample, jnp.float32), jnp.asarray(w), jnp.asarray(segment),
                                     jnp.asarray(s), jnp.asarray(static_scale), linears=len(weights)),
                        np.float64).mean(axis=1)
    tried = {float(a): float(e) for a, e in zip(grid, errors)}
    best = candidates[int(np.argmin(errors))]  # the first minimum: the smaller alpha on a tie
    return best, tried
