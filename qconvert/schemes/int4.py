"""`--scheme int4`: symmetric int4 weights per group of input channels, float activations (W4A16).

Written in compressed-tensors `pack-quantized` (4 bits), which vLLM serves with
its Machete or Marlin kernels. Plain rounding is compressed-tensors' own
round-to-nearest, byte for byte: per output row and group of `group_size`
input columns, scale = absmax / 7.5 (its symmetric range (7 - -8) / 2) in the
weight's dtype, a zero scale replaced by that dtype's eps, and
code = round_half_even(w / scale) clamped to [-8, 7], the quotient taken in
the weight's dtype as torch takes it (the float32 quotient, rounded once more).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_int4 import PackQuantizedInt4
from qconvert.formats.qarray import INT4_QMAX, INT4_QMIN, QArray
from qconvert.formats.quotient import f32_quotient
from qconvert.schemes.rowwise import all_finite_hint, quantize_per_row
from qconvert.schemes.base import ClipSearch, Scheme, SearchResult, Thresholds
from qconvert.schemes.grids import IntegerGrid

DEFAULT_GROUP_SIZE = 128
GROUP_SIZES = (128, 64, 32)  # the default's fallbacks, largest first; then per channel
HALF_RANGE = (INT4_QMAX - INT4_QMIN) / 2  # 7.5: compressed-tensors' symmetric scale divisor
INT4_CLIP_GRID = tuple(round(1.0 - 0.0125 * k, 4) for k in range(21))  # 1.00 .. 0.75


def in_dtype(x: jax.Array, dtype) -> jax.Array:
    """float32 x rounded to `dtype`'s precision (range and mantissa), kept float32.

    An explicit reduce_precision: XLA may drop a cast to bf16 and back as excess
    precision (seen: the divisor taken from the unrounded scale at 512 rows).
    """
    info = jnp.finfo(dtype)
    x = x.astype(jnp.float32)
    if info.bits >= 32:
        return x
    rounded = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    # reduce_precision flushes the dtype's subnormals to zero; the dtype keeps them (a float16 scale of a small
    # group is one), on a grid of smallest_normal * 2^-mantissa. Where that grid lies in float32's normal range
    # (float16's), round onto it: a power-of-two scaling and a round half to even, exact in float32.
    tiny = float(info.smallest_normal)
    step = tiny * 2.0 ** -info.nmant
    if step < float(jnp.finfo(jnp.float32).smallest_normal):
        return rounded  # bfloat16's subnormals are float32's, which XLA's CPU flushes alike
    subnormal = jnp.round(x / jnp.float32(step)) * jnp.float32(step)
    return jnp.where(jnp.abs(x) < jnp.float32(tiny), subnormal, rounded)


@functools.partial(jax.jit, static_argnames=("group", "scale_dtype"))
def int4_codes_and_scales(w: jax.Array, group: int, scale_dtype, clip: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Codes int8 [rows, cols], scales [rows, cols / group] in scale_dtype, and a finite hint.

    `clip` (float32 [rows, cols / group], optional) shrinks each group's absmax
    first (a searched ratio). Call inside `x64()`.
    """
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    absmax = jnp.max(jnp.abs(groups), axis=2).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    # The scale is rounded to its dtype before it divides, as loaders multiply by the rounded one.
    scale = in_dtype(f32_quotient(absmax, jnp.float32(HALF_RANGE)), scale_dtype)
    scale = jnp.where(scale == 0, jnp.float32(jnp.finfo(scale_dtype).eps), scale)
    quotient = in_dtype(f32_quotient(groups.astype(jnp.float32), scale[..., None]), w.dtype)
    codes = jnp.round(jnp.clip(quotient, INT4_QMIN, INT4_QMAX))
    return codes.astype(jnp.int8).reshape(rows, cols), scale.astype(scale_dtype), all_finite_hint(w)


def quantize_int4(w, group_size: int | None, *, scale_dtype=None, clip=None) -> QArray:
    """Symmetric int4 of a [out, in] weight per output row and group of input columns (None: per channel).

    Rows go through the kernel in chunks (rowwise.quantize_per_row). InvalidWeightError for NaN/Inf.
    """
    return quantize_int4_groups(w, group_size, int4_codes_and_scales, scale_dtype=scale_dtype, clip=clip)


def quantize_int4_groups(w, group_size: int | None, codes, *, scale_dtype=None, clip=None) -> QArray:
    """A [out, in] weight through an int4 codes kernel (`codes(part, group, scale_dtype, ratios)`, symmetric or
    with zero points) per output row and group of input columns (None: per channel), rows in chunks."""
    def kernel(part, dtype, ratios):
        return codes(part, group_size or part.shape[1], dtype, ratios)

    return quantize_per_row(w, kernel, np.int8, "int4", scale_dtype=scale_dtype, clip=clip, group_size=group_size)


@functools.partial(jax.jit, static_argnames=("group",))
def _group_errors(w: jax.Array, grid: jax.Array, group: int) -> jax.Array:
    """[ratios, rows, groups] squared weight error of each group with scale = c * absmax / 7.5."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    absmax = jnp.max(jnp.abs(groups), axis=2, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / HALF_RANGE, 1e-12)
        d = groups - jnp.clip(jnp.round(groups / scale), INT4_QMIN, INT4_QMAX) * scale
        return jnp.sum(d * d, axis=2)

    return jax.lax.map(one, grid)


def int4_clip_search(w: np.ndarray, group_size: int | None, grid: tuple[float, ...] = INT4_CLIP_GRID
                     ) -> SearchResult:
    """Per output row and group, the absmax ratio c minimising the group's squared weight error."""
    return grid_search_per_group(_group_errors, w, group_size, grid)


def grid_search_per_group(group_errors, w: np.ndarray, group_size: int | None, grid: tuple[float, ...]
                          ) -> SearchResult:
    """Per output row and group, the ratio of `grid` (largest first) whose error is least: `group_errors(w,
    grid, group)` gives [ratios, rows, groups] errors of the float32 weight; the first minimum (the largest
    ratio) wins a tie."""
    w32 = np.asarray(w, np.float32)
    errors = np.asarray(group_errors(jnp.asarray(w32), jnp.asarray(grid, jnp.float32), group_size or w32.shape[1]),
                        np.float64)
    best = np.argmin(errors, axis=0)
    chosen = np.take_along_axis(errors, best[None], axis=0)[0]
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()), float(chosen.sum()))


def resolve_group_size(requested: int | str | None, shapes: Mapping[str, tuple[int, int]]) -> tuple[int | None, str]:
    """The group size to write (None: per channel) and, when the default had to fall back, one line saying so.

    An explicit size that does not divide every quantized linear's input width is a UsageError.
    """
    widths = {m: int(shape[1]) for m, shape in shapes.items()}
    if requested == "channel":
        return None, ""
    if requested is not None:
        bad = next((m for m, k in sorted(widths.items()) if k % int(requested)), None)
        if bad is not None:
            fits = [g for g in GROUP_SIZES if all(k % g == 0 for k in widths.values())]
            raise UsageError(f"--group-size {requested} does not divide {bad}'s input width {widths[bad]}; "
                             f"use {' or '.join(map(str, fits)) or 'channel'}" + (" or channel" if fits else ""))
        return int(requested), ""
    for group in GROUP_SIZES:
        if all(k % group == 0 for k in widths.values()):
            if group == DEFAULT_GROUP_SIZE:
                return group, ""
            return group, f"int4: group size {group} (128 does not divide every input width)"
    return None, "int4: one scale per output channel (no group size of 128, 64 or 32 divides every input width)"


# verify's floors for 4-bit weights in groups (FP4 in groups of 16 or 32 loses about what these do in 128).
INT4_THRESHOLDS = Thresholds(
    min_layer_sqnr_db=12.0, min_layer_cosine=0.97, max_mean_kl=0.15,
    min_top1_agreement=0.65, max_perplexity_ratio=1.35, min_pooled_cosine=0.91,
    min_fidelity_sqnr_db=40.0,
)

class Int4(Scheme):
    """Symmetric int4 codes with one scale per output row and group of input columns, float activations."""

    name = "int4"
    layout = PackQuantizedInt4()
    takes_group_size = True
    default_gptq = True
    # AWQ then GPTQ: on SmolLM2-135M and Gemma 3 270M it beat GPTQ alone, AWQ alone and rounding (docs/ACCURACY.md)
    default_awq = True
    clip = ClipSearch(INT4_CLIP_GRID, "per output row and group: scale = c * absmax / 7.5")
    thresholds = INT4_THRESHOLDS

    def layout_flags(self, *, act: str = "dynamic", double_quant: bool = False, group_size: int | str | None = None,
                     shapes: Mapping[str, tuple[int, int]] | None = None) -> LayoutFlags:
        group, _ = resolve_group_size(group_size, shapes or {})
        return LayoutFlags(group_size=group)

    def group_note(self, group_size: int | str | None, shapes: Mapping[str, tuple[int, int]]) -> str:
        """The one line saying the default group size fell back ('' when it did not)."""
        return resolve_group_size(group_size, shapes)[1]

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_int4(weight, flags.group_size, scale_dtype=scale_dtype, clip=clip)

    def gptq_grid(self):
        return IntegerGrid(INT4_QMIN, INT4_QMAX)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return int4_clip_search(weight, flags.group_size)
