"""dot_general, dot and a linear hook on jax.Arrays and QArrays, mirroring jax.lax / jax.numpy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.ops import kernel_calls
from qconvert.ops.dispatch import (
    DEQUANTIZE,
    INT8_INT32,
    INT8_KERNEL,
    INT4_WEIGHT_KERNEL,
    INT8_WEIGHT_KERNEL,
    NF4_KERNEL,
    PREPARED,
    MatmulForm,
    choose_path,
    operand_shape,
)
from qconvert.ops.scales import apply_scales, as_float, float_aval, free_dims, lhs_scale_in_output, rhs_scale_in_output


def _normalize(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(int(d) for d in lc), tuple(int(d) for d in rc)), (tuple(int(d) for d in lb), tuple(int(d) for d in rb))


def matmul_form(lhs_shape, rhs_shape, dimension_numbers) -> MatmulForm | None:
    """The plain-matmul reading of a dot_general, or None when it is not one."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb or len(lc) != 1 or len(rhs_shape) != 2 or len(lhs_shape) < 1:
        return None
    if lc[0] != len(lhs_shape) - 1:
        return None
    return MatmulForm(rhs_layout="kn" if rc[0] == 0 else "nk")


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, *, _op: str = "dot_general"):
    """jax.lax.dot_general where either operand may be a QArray.

    The result (shape and dtype) is what jax.lax.dot_general gives for the
    dequantized operands. int8 x int8 with scales that are size 1 on every
    contracting dim runs as an int32-accumulated integer dot (a Pallas kernel
    for a plain matmul) with the scales applied to the output; an NF4 or int4
    weight in a plain matmul goes to its kernel; anything else dequantizes first.
    """
    dn = _normalize(dimension_numbers)
    if kernel_calls.is_prepared(lhs) or kernel_calls.is_prepared(rhs):
        return _prepared_dot_general(lhs, rhs, dn, preferred_element_type, _op)
    out = jax.eval_shape(
        functools.partial(jax.lax.dot_general, dimension_numbers=dn, precision=precision,
                          preferred_element_type=preferred_element_type),
        float_aval(lhs), float_aval(rhs),
    )
    lhs_shape, rhs_shape = operand_shape(lhs), operand_shape(rhs)
    decision = choose_path(
        _op, lhs, rhs, lhs_contracting=dn[0][0], rhs_contracting=dn[0][1], out_dtype=out.dtype,
        matmul_form=matmul_form(lhs_shape, rhs_shape, dn),
    )
    if decision.path == INT8_KERNEL:
        return kernel_calls.int8_matmul(lhs, rhs, matmul_form(lhs_shape, rhs_shape, dn), out.dtype)
    if decision.path == INT8_INT32:
        return int8_dot_general(lhs, rhs, dn, out.dtype)
    if decision.path == INT8_WEIGHT_KERNEL:
        return kernel_calls.int8_weight_matmul(lhs, rhs, out.dtype)
    if decision.path == NF4_KERNEL:
        return kernel_calls.nf4_matmul(lhs, rhs, out.dtype)
    if decision.path == INT4_WEIGHT_KERNEL:
        return kernel_calls.int4_weight_matmul(lhs, rhs, out.dtype)
    assert decision.path == DEQUANTIZE
    return jax.lax.dot_general(as_float(lhs), as_float(rhs), dn, precision=precision,
                               preferred_element_type=preferred_element_type)


def _prepared_dot_general(lhs, rhs, dn, preferred_element_type, op: str) -> jax.Array:
    """x [..., K] . W^T for a prepared weight W [N, K], the one form its kernel operand takes."""
    if isinstance(lhs, QArray) or kernel_calls.is_prepared(lhs) or dn != (((jnp.ndim(lhs) - 1,), (1,)), ((), ())):
        raise kernel_calls.PreparedWeightError(f"ops.{op}: {kernel_calls.PREPARED_ONLY_LINEAR}")
    out_dtype = jnp.dtype(jnp.result_type(lhs) if preferred_element_type is None else preferred_element_type)
    if not jnp.issubdtype(out_dtype, jnp.floating):  # the kernels write float outputs only
        raise kernel_calls.PreparedWeightError(f"ops.{op}: a prepared weight gives a float result, "
                                               f"not {out_dtype}")
    decision = choose_path(op, lhs, rhs, lhs_contracting=dn[0][0], rhs_contracting=dn[0][1], out_dtype=out_dtype,
                           matmul_form=MatmulForm(rhs_layout="nk"))
    assert decision.path == PREPARED
    return kernel_calls.prepared_matmul(lhs, rhs, out_dtype)


def int8_dot_general(lhs: QArray, rhs: QArray, dimension_numbers, out_dtype) -> jax.Array:
    """The integer path: int8 payloads, int32 accumulation, then lhs and rhs scales on the output."""
    acc = jax.lax.dot_general(lhs.qvalue, rhs.qvalue, dimension_numbers, preferred_element_type=jnp.int32)
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_free = len(free_dims(lhs.qvalue.ndim, lc, lb))
    rhs_free = len(free_dims(rhs.qvalue.ndim, rc, rb))
    return apply_scales(
        acc,
        lhs_scale_in_output(lhs.scale, dimension_numbers, rhs_free),
        rhs_scale_in_output(rhs.scale, dimension_numbers, lhs_free),
        out_dtype,
    )


def dot(a, b, *, precision=None, preferred_element_type=None):
    """jax.numpy.dot where either operand may be a QArray.

    Contracts the last axis of `a` with the second-to-last axis of `b` (its only
    axis when `b` is 1-D); a 0-D operand multiplies elementwise.
    """
    a_ndim, b_ndim = len(operand_shape(a)), len(operand_shape(b))
    if a_ndim == 0 or b_ndim == 0:
        return jnp.dot(as_float(a), as_float(b), precision=precision, preferred_element_type=preferred_element_type)
    b_axis = 0 if b_ndim == 1 else b_ndim - 2
    out_type = preferred_element_type
    if out_type is None:
        # jnp.dot promotes the operands to their common dtype first.
        out_type = jnp.result_type(float_aval(a).dtype, float_aval(b).dtype)
    return dot_general(a, b, (((a_ndim - 1,), (b_axis,)), ((), ())), precision=precision,
                       preferred_element_type=out_type, _op="dot")


def linear(name: str, x: jax.Array, weight, bias=None) -> jax.Array:
    """A linear hook for qconvert.models forwards: y = x W^T + b with W [out, in] float or QArray.

    Runs through dot_general, so an NF4 or int4 weight goes to its kernel and an
    int8 weight (weight-only) is dequantized next to the matmul. A prepared
    weight (qconvert.load(..., prepare=True)) goes to its kernel as it was laid
    out at load time, nothing repacked per call; it is inference-only.
    """
    del name
    y = dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32, _op="linear")
    if bias is not None:
        y = y + as_float(bias).astype(jnp.float32)
    return y
