"""Shapes of op operands: the logical shape of a QArray (or prepared weight) and the plain-matmul reading of a dot."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from qconvert.formats.qarray import QArray, is_prepared


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """How an op maps onto a plain 2-D matmul x[M, K] @ w, if it does.

    `rhs_layout` is "kn" when the rhs is [K, N] and "nk" when it is [N, K] (a
    linear weight [out, in] contracted on its input axis).
    """

    rhs_layout: str


def operand_shape(x) -> tuple[int, ...]:
    """Logical shape; for int8 QArrays read from the payload so it stays right under vmap."""
    if isinstance(x, QArray):
        return tuple(x.qvalue.shape) if x.kind.int8 else tuple(x.shape)
    if is_prepared(x):
        return (x.n, x.k)
    return tuple(jnp.shape(x))
