"""SmoothQuant's math: per-channel smoothing scales from activation and weight maxima (folded by methods/fold.py).

For a group (a norm or a linear whose output feeds some linears), input channel j
gets s_j = max|X_j|^a / max|W_j|^(1-a) (float32, both maxima and s clamped at
>= 1e-5; max|W_j| is the element-wise max over the group's linears). X / s is
what the linears then see, W * s their weights: the float product is unchanged,
while the activation outliers move into the weights, where per-channel int8
takes them easily. 1/s is folded into the source: a norm's weight (and
LayerNorm bias), or a source linear's output rows (and bias).
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.qarray import INT8_QMAX
from qconvert.formats.quotient import int8_round
from qconvert.methods.fold import MIN_SCALE, GroupScales, channel_map, source_scales
from qconvert.models.family import SmoothingGroup

ALPHA_GRID = tuple(round(0.05 * k, 2) for k in range(21))
_HI = jax.lax.Precision.HIGHEST


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


def group_scales(group: SmoothingGroup, act_absmax: np.ndarray, weights: Sequence[np.ndarray],
                 alpha: float) -> GroupScales:
    """Smoothing scales of one group from its input's act_absmax [in] and its linears' weights."""
    index = channel_map(group, len(act_absmax))
    src_act = reduce_to_source(act_absmax, index)
    src_w = reduce_to_source(weight_absmax(weights), index)
    s = source_scales(smooth_scales(src_act, src_w, alpha), index)
    return GroupScales(group, float(alpha), s, s[index])


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
        s_alpha = source_scales(smooth_scales(src_act, src_w, alpha), index)
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
