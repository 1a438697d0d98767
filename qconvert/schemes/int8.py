"""`--scheme int8`: int8 weights per output channel, float activations (W8A16), compressed-tensors pack-quantized.

Per output row: scale = absmax / 127 (rounded to the scale dtype), codes = round_half_even(w / scale), the
quotient exact (schemes/rowwise.py). The clip search tries scale = c * absmax / 127 on a fixed grid of c and
keeps, per row, the c with the least squared error: the row's output error ||X (w - w_q)||^2 on calibration
activations X, or its weight error ||w - w_q||^2 without (ties go to the larger c, ratio 1.0 is on the grid).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_int8 import PackQuantizedInt8
from qconvert.formats.qarray import INT8_QMAX, QArray
from qconvert.formats.quotient import f32_quotient, int8_round
from qconvert.schemes.grids import IntegerGrid
from qconvert.schemes.base import ClipSearch, Scheme, SearchResult, Thresholds
from qconvert.schemes.rowwise import all_finite_hint, quantize_per_row, scale_floor

# Candidate clipping ratios, largest (plain absmax) first.
# int8: fine steps near 1 (127 levels leave little to clip), coarser below 0.95.
INT8_CLIP_GRID = (tuple(round(1.0 - 0.005 * k, 3) for k in range(10))
                  + tuple(round(0.95 - 0.025 * k, 3) for k in range(11)))      # 1.000 .. 0.70


OUTPUT_ERROR_ROWS = 64  # calibration rows the int8 output-error search uses (cost: rows x in x out per ratio)


_HI = jax.lax.Precision.HIGHEST


def _first_min(errors: jax.Array) -> jax.Array:
    # argmin over the candidate axis 0; jnp.argmin returns the first minimum, i.e. the largest ratio.
    return jnp.argmin(errors, axis=0)

@functools.partial(jax.jit, static_argnames=("scale_dtype",))
def int8_codes_and_scales(w: jax.Array, scale_dtype, clip: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per output row: scale = absmax / 127 (rounded to scale_dtype), q = round_half_even(w / scale).

    `clip` (float32 [rows, 1], optional) shrinks each row's absmax first (a
    searched clipping ratio); codes beyond it clamp to +-127. The third result
    is False when w may hold NaN/Inf (see `all_finite_hint`). Call inside `x64()`.
    """
    # max|w| is exact in w's own dtype; reducing it there keeps XLA from materializing a float32 copy.
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    scale = jnp.maximum(f32_quotient(absmax, jnp.float32(INT8_QMAX)), scale_floor(scale_dtype))
    scale = scale.astype(scale_dtype)
    # Divide by the scale exactly as loaders will multiply it back: the rounded one.
    q = int8_round(w, scale)
    return q.astype(jnp.int8), scale, all_finite_hint(w)


def quantize_int8(w, *, scale_dtype=None, clip=None) -> QArray:
    """Symmetric per-output-channel int8 of a [out, in] weight; scale_dtype defaults to w's dtype.

    `clip` (float32 [out], optional): per-row clipping ratios from a scale
    search; the scale is then clip * absmax / 127. Raises InvalidWeightError for NaN/Inf values.
    """
    return quantize_per_row(w, int8_codes_and_scales, np.int8, "int8", scale_dtype=scale_dtype, clip=clip)


@jax.jit
def _int8_row_errors(w: jax.Array, x: jax.Array, grid: jax.Array) -> jax.Array:
    """[ratios, out] squared error of each row quantized with scale = c * absmax / 127.

    x [rows, in] gives output errors; x with zero rows gives weight errors (see callers).
    """
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / INT8_QMAX, 1e-12)
        d = w - int8_round(w, scale) * scale
        return jnp.sum(jnp.matmul(x, d.T, precision=_HI) ** 2, axis=0)

    return jax.lax.map(one, grid)


@jax.jit
def _int8_row_weight_errors(w: jax.Array, grid: jax.Array) -> jax.Array:
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / INT8_QMAX, 1e-12)
        return jnp.sum((w - int8_round(w, scale) * scale) ** 2, axis=1)

    return jax.lax.map(one, grid)


def int8_clip_search(w: np.ndarray, x: np.ndarray | None = None,
                     grid: tuple[float, ...] = INT8_CLIP_GRID) -> SearchResult:
    """Per output row of w [out, in], the clipping ratio c minimising the output (or weight) error.

    With x [rows, in] (calibration activations, up to OUTPUT_ERROR_ROWS used) the
    error is ||x (w_row - w_q_row)||^2; without, ||w_row - w_q_row||^2.
    """
    w32 = jnp.asarray(np.asarray(w, np.float32))
    g = jnp.asarray(grid, jnp.float32)
    if x is not None and len(x):
        x = np.asarray(x, np.float32)
        x = x[:: max(1, len(x) // OUTPUT_ERROR_ROWS)][:OUTPUT_ERROR_ROWS]
        errors = _int8_row_errors(w32, jnp.asarray(x), g)
    else:
        errors = _int8_row_weight_errors(w32, g)
    errors = np.asarray(errors, np.float64)
    best = np.asarray(_first_min(jnp.asarray(errors)))
    rows = np.arange(errors.shape[1])
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()),
                        float(errors[best, rows].sum()))



INT8_CLIP = ClipSearch(INT8_CLIP_GRID, "per output channel: scale = c * absmax / 127")


class Int8(Scheme):
    """Symmetric int8 codes, scale = absmax / 127 per output row, activations left in float."""

    name = "int8"
    layout = PackQuantizedInt8()
    clip = INT8_CLIP
    thresholds = Thresholds(
        min_layer_sqnr_db=30.0, min_layer_cosine=0.999, max_mean_kl=0.01,
        min_top1_agreement=0.90, max_perplexity_ratio=1.02, min_pooled_cosine=0.998,
    )

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_int8(weight, scale_dtype=scale_dtype, clip=clip)

    def gptq_grid(self):
        return IntegerGrid(-INT8_QMAX, INT8_QMAX)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return int8_clip_search(weight)
