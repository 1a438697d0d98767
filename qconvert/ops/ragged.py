"""ragged_dot and ragged_dot_general on jax.Arrays and QArrays, mirroring jax.lax.

A ragged dot multiplies row groups of the lhs by per-group rhs slices (the
mixture-of-experts matmul). On the integer path the lhs scale factors out as
in dot_general; a per-group rhs scale (full along the rhs group dim) is
gathered per lhs row from the group sizes, since row i belongs to the group
whose range covers it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.ops.dispatch import INT8_INT32, choose_path, operand_shape
from qconvert.ops.scales import (
    apply_scales,
    as_float,
    float_aval,
    free_dims,
    lhs_scale_in_output,
    rhs_scale_in_output,
)


def _mode(dims: jax.lax.RaggedDotDimensionNumbers) -> str:
    (lhs_contracting, _), (lhs_batch, _) = dims.dot_dimension_numbers
    ragged = dims.lhs_ragged_dimensions[0]
    if ragged in lhs_contracting:
        return "contracting"
    return "batch" if ragged in lhs_batch else "noncontracting"


def _rhs_factor_per_row(rhs_scale, dims, group_sizes, lhs_ndim: int, rows: int) -> jax.Array:
    """A per-group rhs scale turned into one scale per lhs row of the ragged dim, in output layout."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = dims.dot_dimension_numbers
    ragged, group_dim = dims.lhs_ragged_dimensions[0], dims.rhs_group_dimensions[0]
    num_groups = group_sizes.shape[-1]
    group_ids = jnp.repeat(jnp.arange(num_groups), group_sizes, total_repeat_length=rows)
    per_row = jnp.take(jnp.asarray(rhs_scale, jnp.float32), group_ids, axis=group_dim)
    rhs_free = free_dims(per_row.ndim, list(rhs_contracting) + [group_dim], rhs_batch)
    moved = jnp.transpose(per_row, list(rhs_batch) + [group_dim] + rhs_free + list(rhs_contracting))
    kept = moved.shape[:len(rhs_batch) + 1 + len(rhs_free)]
    lhs_free = free_dims(lhs_ndim, lhs_contracting, lhs_batch)
    before = lhs_free.index(ragged)
    after = len(lhs_free) - before - 1
    nb = len(rhs_batch)
    shape = kept[:nb] + (1,) * before + (rows,) + (1,) * after + kept[nb + 1:]
    return moved.reshape(kept).reshape(shape)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None) -> jax.Array:
    """jax.lax.ragged_dot_general where either operand may be a QArray.

    The integer path runs when both operands are int8 with scales of size 1
    along every contracting dim, no group_offset is given, and a per-group rhs
    scale (if any) comes with 1-D group_sizes.
    """
    dims = ragged_dot_dimension_numbers
    op = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=dims, group_offset=group_offset)
    out = jax.eval_shape(functools.partial(op, precision=precision, preferred_element_type=preferred_element_type),
                         float_aval(lhs), float_aval(rhs), group_sizes)
    (lhs_contracting, rhs_contracting), _ = dims.dot_dimension_numbers
    mode = _mode(dims)
    per_group_scale = (
        mode == "noncontracting" and isinstance(rhs, QArray) and rhs.kind.int8
        and rhs.scale.ndim == rhs.qvalue.ndim
        and rhs.scale.shape[dims.rhs_group_dimensions[0]] != 1
    )
    blocker = None
    if group_offset is not None:
        blocker = "group_offset is given"
    elif per_group_scale and jnp.ndim(group_sizes) != 1:
        blocker = "a per-group rhs scale needs 1-D group_sizes"
    decision = choose_path("ragged_dot_general", lhs, rhs, lhs_contracting=lhs_contracting,
                           rhs_contracting=rhs_contracting, out_dtype=out.dtype, int8_blocker=blocker)
    if decision.path != INT8_INT32:
        return op(as_float(lhs), as_float(rhs), group_sizes, precision=precision,
                  preferred_element_type=preferred_element_type)
    acc = op(lhs.qvalue, rhs.qvalue, group_sizes, preferred_element_type=jnp.int32)
    lhs_factor, rhs_factor = _int8_scale_factors(lhs, rhs, group_sizes, dims, per_group_scale, mode)
    return apply_scales(acc, lhs_factor, rhs_factor, out.dtype)


def _int8_scale_factors(lhs: QArray, rhs: QArray, group_sizes, dims, per_group_scale: bool, mode: str):
    """The lhs and rhs scales laid out along the int32 accumulator's dims (rhs per row where its scale is per
    group)."""
    dn = dims.dot_dimension_numbers
    group_dims = list(dims.rhs_group_dimensions)
    (lhs_contracting, rc), (lb, rb) = dn
    rhs_free = len(free_dims(rhs.qvalue.ndim, list(rc) + group_dims, rb))
    lhs_free = len(free_dims(lhs.qvalue.ndim, lhs_contracting, lb))
    lhs_factor = lhs_scale_in_output(lhs.scale, dn, rhs_free)
    if per_group_scale:
        rows = operand_shape(lhs)[dims.lhs_ragged_dimensions[0]]
        rhs_factor = _rhs_factor_per_row(rhs.scale, dims, jnp.asarray(group_sizes), lhs.qvalue.ndim, rows)
    else:
        rhs_factor = rhs_scale_in_output(rhs.scale, dn, lhs_free, skip=group_dims)
    if mode == "contracting":
        # The output gains a leading group dim that neither scale varies along.
        lhs_factor, rhs_factor = lhs_factor[None], rhs_factor[None]
    return lhs_factor, rhs_factor


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None) -> jax.Array:
    """jax.lax.ragged_dot (lhs [m, k], rhs [g, k, n], group_sizes [g]) where either operand may be a QArray."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return ragged_dot_general(lhs, rhs, group_sizes, dims, precision=precision,
                              preferred_element_type=preferred_element_type, group_offset=group_offset)


def grouped_linear(names, x: jax.Array, weights, group_sizes: jax.Array) -> jax.Array:
    """A grouped linear hook for qconvert.models MoE forwards: rows of group e times weights[e]^T.

    The E expert weights [out, in] (float or QArrays of one kind) are stacked
    packed into [E, out, in] and multiplied through ragged_dot_general; rows
    past sum(group_sizes) give zeros.
    """
    del names
    from qconvert.ops.layout import stack

    stacked = stack(list(weights))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return ragged_dot_general(x, stacked, jnp.asarray(group_sizes, jnp.int32), dims,
                              preferred_element_type=jnp.float32)
