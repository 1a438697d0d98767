"""conv_general_dilated on jax.Arrays and QArrays, mirroring jax.lax.conv_general_dilated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.ops.dispatch import INT8_INT32, choose_path, operand_shape
from qconvert.ops.scales import apply_scales, as_float, float_aval


def _factor_at(scale, source_axis: int, out_axis: int, out_ndim: int) -> jax.Array:
    """A scale varying only along `source_axis`, laid along `out_axis` of the output."""
    values = jnp.asarray(scale, jnp.float32).reshape(scale.shape[source_axis])
    shape = [1] * out_ndim
    shape[out_axis] = values.shape[0]
    return values.reshape(shape)


def conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                         dimension_numbers=None, feature_group_count: int = 1, batch_group_count: int = 1,
                         precision=None, preferred_element_type=None) -> jax.Array:
    """jax.lax.conv_general_dilated where the input and/or the kernel may be a QArray.

    The integer path needs the input scale shared over features and space (per
    tensor, or per batch element) and the kernel scale shared over input
    features and space (per tensor, or per output feature); it convolves the
    int8 payloads with int32 accumulation and scales the output.
    """
    conv = functools.partial(
        jax.lax.conv_general_dilated, window_strides=window_strides, padding=padding,
        lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count, batch_group_count=batch_group_count,
    )
    out = jax.eval_shape(functools.partial(conv, precision=precision, preferred_element_type=preferred_element_type),
                         float_aval(lhs), float_aval(rhs))
    lhs_shape, rhs_shape = operand_shape(lhs), operand_shape(rhs)
    dn = jax.lax.conv_dimension_numbers(lhs_shape, rhs_shape, dimension_numbers)
    decision = choose_path(
        "conv_general_dilated", lhs, rhs,
        lhs_contracting=dn.lhs_spec[1:], rhs_contracting=dn.rhs_spec[1:], out_dtype=out.dtype,
        int8_blocker="batch_group_count > 1 mixes batch elements into features" if batch_group_count != 1 else None,
    )
    if decision.path == INT8_INT32:
        acc = conv(lhs.qvalue, rhs.qvalue, preferred_element_type=jnp.int32)
        out_ndim = len(out.shape)
        lhs_factor = _factor_at(lhs.scale, dn.lhs_spec[0], dn.out_spec[0], out_ndim)
        rhs_factor = _factor_at(rhs.scale, dn.rhs_spec[0], dn.out_spec[1], out_ndim)
        return apply_scales(acc, lhs_factor, rhs_factor, out.dtype)
    return conv(as_float(lhs), as_float(rhs), precision=precision, preferred_element_type=preferred_element_type)

