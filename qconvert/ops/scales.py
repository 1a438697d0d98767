"""Moving per-operand scales into a dot's output layout, and the float avals of operands.

jax.lax.dot_general lays its output out as (batch dims, lhs free dims, rhs free
dims). A scale that is size 1 along every contracting dim factors out of the
sum, so it becomes an output-shaped broadcast factor: drop its contracting
dims, order the rest like the output, and put size-1 axes where the other
operand's free dims go.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.ops import kernel_calls
from qconvert.ops.dispatch import operand_shape


def _refuse_prepared(x) -> None:
    if kernel_calls.is_prepared(x):
        raise kernel_calls.PreparedWeightError(kernel_calls.PREPARED_ONLY_LINEAR)


def float_aval(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype `x` has as a float operand (a QArray's dequantized form)."""
    _refuse_prepared(x)
    if isinstance(x, QArray):
        return jax.ShapeDtypeStruct(operand_shape(x), jnp.dtype(x.dtype))
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def as_float(x) -> jax.Array:
    """A QArray dequantized to its own float dtype; any other operand as it is."""
    _refuse_prepared(x)
    return x.dequantize() if isinstance(x, QArray) else x


def free_dims(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
    """The dims of an operand that are neither contracted nor batched, ascending."""
    taken = set(contracting) | set(batch)
    return [d for d in range(ndim) if d not in taken]


def _squeeze_to(scale: jax.Array, order: Sequence[int], keep: int) -> jax.Array:
    """Transpose `scale` to `order` and drop everything after the first `keep` axes (all size 1)."""
    moved = jnp.transpose(jnp.asarray(scale, jnp.float32), tuple(order))
    return moved.reshape(moved.shape[:keep])


def lhs_scale_in_output(scale, dimension_numbers, rhs_free_count: int) -> jax.Array:
    """The lhs scale as a factor broadcastable against dot_general's output."""
    (lhs_contracting, _), (lhs_batch, _) = dimension_numbers
    free = free_dims(scale.ndim, lhs_contracting, lhs_batch)
    kept = _squeeze_to(scale, list(lhs_batch) + free + list(lhs_contracting), len(lhs_batch) + len(free))
    return kept.reshape(kept.shape + (1,) * rhs_free_count)


def rhs_scale_in_output(scale, dimension_numbers, lhs_free_count: int, skip: Sequence[int] = ()) -> jax.Array:
    """The rhs scale as a factor broadcastable against dot_general's output.

    `skip` names rhs dims (size 1 in the scale) that do not appear in the output,
    such as a ragged dot's group dim.
    """
    (_, rhs_contracting), (_, rhs_batch) = dimension_numbers
    gone = list(rhs_contracting) + list(skip)
    free = free_dims(scale.ndim, gone, rhs_batch)
    kept = _squeeze_to(scale, list(rhs_batch) + free + gone, len(rhs_batch) + len(free))
    nb = len(rhs_batch)
    return kept.reshape(kept.shape[:nb] + (1,) * lhs_free_count + kept.shape[nb:])


def apply_scales(acc: jax.Array, lhs_factor: jax.Array, rhs_factor: jax.Array, out_dtype) -> jax.Array:
    """Rescale an int32 accumulator: float32(acc) * lhs_factor, then * rhs_factor, one cast.

    The order matches the int8 kernel's documented rescale, so the integer path
    and the kernel agree bit for bit.
    """
    return ((acc.astype(jnp.float32) * lhs_factor) * rhs_factor).astype(out_dtype)
