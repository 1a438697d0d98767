"""`--scheme int4-asym`: int4 weights with a scale and a zero point per group of input channels (W4A16_ASYM).

Written in compressed-tensors `pack-quantized` (4 bits) with `weight_zero_point`, which vLLM serves with its
Marlin / Machete kernels with zero points. Plain rounding is compressed-tensors' own min-max round-to-nearest,
byte for byte, each step in the dtype torch takes it in (the weight's; float32 quotients rounded once more):

    low = min(group min, 0), high = max(group max, 0)           (0 stays representable)
    scale = (high - low) / 15                                   two roundings: the difference, the quotient
    zero = clamp(-8 - low / scale, -8, 7), then rounded half to even to an integer (a 0/0 zero point is 0)
    scale = eps of its dtype where it is 0                      (after the zero point, as compressed-tensors does)
    code = round_half_even(clamp(w / scale + zero, -8, 7))      the quotient and the sum each rounded to the dtype

so the weight a loader computes is (code - zero) * scale. Group sizes, their fallbacks and refusals are int4's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_int4_asym import PackQuantizedInt4Asym
from qconvert.formats.qarray import INT4_QMAX, INT4_QMIN, QArray, group_scale
from qconvert.formats.quotient import f32_quotient
from qconvert.schemes.base import ClipSearch, SearchResult
from qconvert.schemes.int4 import INT4_CLIP_GRID, Int4, grid_search_per_group, in_dtype, quantize_int4_groups
from qconvert.schemes.rowwise import all_finite_hint

LEVELS = INT4_QMAX - INT4_QMIN  # 15: compressed-tensors' asymmetric scale divisor


@functools.partial(jax.jit, static_argnames=("group", "scale_dtype"))
def int4_asym_codes(w: jax.Array, group: int, scale_dtype, clip: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Codes int8 [rows, cols], scales [rows, cols / group] in scale_dtype, zero points int8 [rows, cols / group]
    and a finite hint. `clip` (float32 [rows, cols / group], optional) shrinks each group's range (min and max
    alike) first: a searched ratio. Call inside `x64()`."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    low = jnp.minimum(jnp.min(groups, axis=2), 0).astype(jnp.float32)
    high = jnp.maximum(jnp.max(groups, axis=2), 0).astype(jnp.float32)
    if clip is not None:
        low, high = in_dtype(low * clip, w.dtype), in_dtype(high * clip, w.dtype)
    scale = in_dtype(f32_quotient(in_dtype(high - low, w.dtype), jnp.float32(LEVELS)), scale_dtype)
    zero = in_dtype(jnp.float32(INT4_QMIN) - in_dtype(f32_quotient(low, scale), w.dtype), w.dtype)
    # torch turns the NaN of an all-zero group (0 / 0) into the integer 0.
    zero = jnp.round(jnp.nan_to_num(jnp.clip(zero, INT4_QMIN, INT4_QMAX), nan=0.0))
    scale = jnp.where(scale == 0, jnp.float32(jnp.finfo(scale_dtype).eps), scale)
    quotient = in_dtype(f32_quotient(groups.astype(jnp.float32), scale[..., None]), w.dtype)
    shifted = in_dtype(quotient + zero[..., None], w.dtype)
    codes = jnp.round(jnp.clip(shifted, INT4_QMIN, INT4_QMAX))
    return (codes.astype(jnp.int8).reshape(rows, cols), scale.astype(scale_dtype), zero.astype(jnp.int8),
            all_finite_hint(w))


def quantize_int4_asym(w, group_size: int | None, *, scale_dtype=None, clip=None) -> QArray:
    """Asymmetric int4 of a [out, in] weight per output row and group of input columns (None: per channel).

    Rows go through the kernel in chunks (rowwise.quantize_per_row). InvalidWeightError for NaN/Inf.
    """
    return quantize_int4_groups(w, group_size, int4_asym_codes, scale_dtype=scale_dtype, clip=clip)


@functools.partial(jax.jit, static_argnames=("group",))
def _group_errors(w: jax.Array, grid: jax.Array, group: int) -> jax.Array:
    """[ratios, rows, groups] squared weight error of each group with its range [low, high] shrunk by c."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // group, group)
    low = jnp.minimum(jnp.min(groups, axis=2, keepdims=True), 0)
    high = jnp.maximum(jnp.max(groups, axis=2, keepdims=True), 0)

    def one(c):
        scale = jnp.maximum(c * (high - low) / LEVELS, 1e-12)
        zero = jnp.round(jnp.clip(INT4_QMIN - c * low / scale, INT4_QMIN, INT4_QMAX))
        codes = jnp.clip(jnp.round(groups / scale) + zero, INT4_QMIN, INT4_QMAX)
        d = groups - (codes - zero) * scale
        return jnp.sum(d * d, axis=2)

    return jax.lax.map(one, grid)


def int4_asym_clip_search(w: np.ndarray, group_size: int | None, grid: tuple[float, ...] = INT4_CLIP_GRID
                          ) -> SearchResult:
    """Per output row and group, the range ratio c minimising the group's squared weight error."""
    return grid_search_per_group(_group_errors, w, group_size, grid)


def _per_weight(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 [out, in] of per-group values [out, groups] (each repeated over its group's columns)."""
    values = np.asarray(values).astype(np.float32)
    if values.shape[-1] not in (1, shape[-1]):
        values = np.repeat(values, shape[-1] // values.shape[-1], axis=-1)
    return np.ascontiguousarray(np.broadcast_to(values, shape))


class Int4Asym(Int4):
    """int4 codes with a scale and an integer zero point per output row and group of input columns."""

    name = "int4-asym"
    layout = PackQuantizedInt4Asym()
    clip = ClipSearch(INT4_CLIP_GRID, "per output row and group: min and max times c, scale = c * (max - min) / 15")

    def group_note(self, group_size: int | str | None, shapes: Mapping[str, tuple[int, int]]) -> str:
        """int4's line about the default group size falling back, naming this scheme."""
        note = super().group_note(group_size, shapes)
        return f"{self.name}:{note.partition(':')[2]}" if note else ""

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_int4_asym(weight, flags.group_size, scale_dtype=scale_dtype, clip=clip)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return int4_asym_clip_search(weight, flags.group_size)

    def gptq_offsets(self, q: QArray, flags: LayoutFlags) -> np.ndarray | None:
        """float32 [out, in]: each weight's zero point, which GPTQ keeps (its codes are round(w / s) + z)."""
        return _per_weight(q.zero_point, q.shape)

    def gptq_qarray(self, q: QArray, codes: np.ndarray) -> QArray:
        return dataclasses.replace(q, qvalue=np.asarray(codes).astype(np.int8))

    def folder_weight(self, q: QArray) -> np.ndarray:
        codes = np.asarray(q.qvalue, np.float64) - _per_weight(q.zero_point, q.shape).astype(np.float64)
        return codes * np.asarray(group_scale(q), np.float64)
