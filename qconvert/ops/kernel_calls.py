"""Handing plain matmuls on QArrays to the Pallas kernels of qconvert.kernels.

A "plain matmul" is lhs [..., K] contracted on its last dim with a 2-D rhs,
no batch dims; the leading lhs dims fold into M. The kernels compute in float32
(int32 accumulation for int8) and apply the rescale in the order the integer
path uses, so the two agree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.ops.dispatch import MatmulForm, operand_shape


def _kernels():
    import qconvert.kernels as kernels

    return kernels


def int8_kernel_blocker(lhs: QArray, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the int8 kernel cannot take this matmul, or None when it can."""
    if not hasattr(_kernels(), "int8_matmul"):
        return "qconvert.kernels has no int8_matmul"
    lhs_scale = lhs.scale.shape
    if any(d != 1 for d in lhs_scale[-1:]):
        return "lhs scale varies along K"
    rhs_shared = 1 if form.rhs_layout == "nk" else 0
    if rhs.scale.shape[rhs_shared] != 1:
        return "rhs scale varies along K"
    return None


def nf4_kernel_blocker(lhs, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the NF4 kernel cannot take this matmul, or None when it can."""
    if not hasattr(_kernels(), "nf4_matmul"):
        return "qconvert.kernels has no nf4_matmul"
    if form.rhs_layout != "nk":
        return "the nf4 weight is contracted on its first axis; the kernel takes [N, K] contracted on K"
    if not jnp.issubdtype(jnp.result_type(lhs), jnp.floating):
        return f"lhs dtype {jnp.result_type(lhs)} is not floating"
    return None


def _rows(x_shape) -> int:
    return math.prod(x_shape[:-1])


def int8_matmul(lhs: QArray, rhs: QArray, form: MatmulForm, out_dtype) -> jax.Array:
    """lhs int8 [..., K] (scale [..., 1]) times rhs int8 [K, N] or [N, K] through the kernel."""
    lhs_shape = operand_shape(lhs)
    m, k = _rows(lhs_shape), lhs_shape[-1]
    x_q = lhs.qvalue.reshape(m, k)
    x_scale = jnp.broadcast_to(jnp.asarray(lhs.scale, jnp.float32), lhs_shape[:-1] + (1,)).reshape(m)
    w_q = rhs.qvalue if form.rhs_layout == "nk" else rhs.qvalue.T
    w_scale = jnp.asarray(rhs.scale, jnp.float32).reshape(-1)
    w_scale = jnp.broadcast_to(w_scale, (w_q.shape[0],))
    y = _kernels().int8_matmul(x_q, w_q, x_scale, w_scale, out_dtype=out_dtype)
    return y.reshape(lhs_shape[:-1] + (w_q.shape[0],))


def nf4_matmul(lhs, rhs: QArray, out_dtype) -> jax.Array:
    """Float lhs [..., K] times an NF4 weight [N, K] through the kernel.

    Pallas kernels have no autodiff rule, so the gradient w.r.t. lhs is given
    here: d lhs = g @ W with W the dequantized weight.
    """
    lhs_shape = tuple(jnp.shape(lhs))
    n, k = rhs.shape

    @jax.custom_vjp
    def matmul(x, packed, absmax):
        return _forward(x, packed, absmax)

    def _forward(x, packed, absmax):
        x2 = x.reshape(_rows(lhs_shape), k)
        y = _kernels().nf4_matmul(x2, packed, absmax, shape=(n, k), blocksize=rhs.block_size, out_dtype=out_dtype)
        return y.reshape(lhs_shape[:-1] + (n,))

    def fwd(x, packed, absmax):
        return _forward(x, packed, absmax), (packed, absmax)

    def bwd(residuals, g):
        packed, absmax = residuals
        weight = QArray(packed, absmax, kind="nf4", block_size=rhs.block_size, shape=rhs.shape, dtype=rhs.dtype)
        dx = jnp.matmul(g.astype(jnp.float32), weight.dequantize(jnp.float32)).astype(jnp.result_type(lhs))
        zero_packed = jnp.zeros(packed.shape, jax.dtypes.float0)
        return dx, zero_packed, jnp.zeros_like(absmax)

    matmul.defvjp(fwd, bwd)
    return matmul(lhs, rhs.qvalue, rhs.scale)
