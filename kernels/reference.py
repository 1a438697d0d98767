"""Pure-jnp references that define the right answer for every kernel in this package.

Each reference is written for reading, not speed: it dequantizes in float32 (or
accumulates in int32) in the most direct way, then applies the documented
rescale order. The kernels must match these (bit-exactly for int8_matmul).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import FP4_LEVELS, NF4_BLOCK_SIZE, NF4_LEVELS
from qconvert.formats.quotient import f32_quotient

HIGHEST = jax.lax.Precision.HIGHEST
# The references are jitted so that XLA fuses their float rescale exactly as it
# fuses the kernels' (a multiply followed by an add may become one fused
# multiply-add on either side; compiled the same way, both give the same bits).


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def int8_matmul_reference(x_q, w_q, x_scale, w_scale, *, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """W8A8: y[m, n] = f32(sum_k x_q[m,k] * w_q[n,k]) * x_scale[m] * w_scale[n] + bias[n].

    The int32 accumulation is exact (an int8 x int8 -> int32 dot, which XLA runs
    as an integer GEMM); the rescale runs in float32 in exactly this order
    (accumulator, times x_scale, times w_scale, plus bias), then one cast.
    """
    acc = jax.lax.dot_general(jnp.asarray(x_q, jnp.int8), jnp.asarray(w_q, jnp.int8), (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)
    m = acc.shape[0]
    x_scale = jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32).reshape(-1), (m,))
    y = acc.astype(jnp.float32) * x_scale[:, None]
    y = y * jnp.asarray(w_scale, jnp.float32).reshape(1, -1)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def fp8_matmul_reference(x_q, w_q, x_scale, w_scale, *, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """FP8 W8A8: y[m, n] = f32(sum_k x_q[m,k] * w_q[n,k]) * x_scale[m] * w_scale[n] + bias[n].

    x_q and w_q are float8_e4m3fn codes. Each is exact in float32 and so is each
    product (4 significant bits times 4), so the sum differs from the exact one
    only by float32 accumulation; the rescale runs in float32 in this order
    (accumulator, times x_scale, times w_scale, plus bias), then one cast.
    """
    acc = jax.lax.dot_general(jnp.asarray(x_q).astype(jnp.float32), jnp.asarray(w_q).astype(jnp.float32),
                              (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=HIGHEST)
    m = acc.shape[0]
    x_scale = jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32).reshape(-1), (m,))
    y = acc * x_scale[:, None]
    y = y * jnp.asarray(w_scale, jnp.float32).reshape(1, -1)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def int8_weight_matmul_reference(x, w_q, w_scale, *, bias=None, out_dtype=jnp.float32) -> jax.Array:
    """W8A16: y = (x @ w_q^T in float32, w_q cast to x's dtype) * w_scale[n] + bias[n].

    int8 codes are exact in bf16, f16 and f32, so casting them to the activation
    dtype loses nothing; the per-channel scale factors out of the sum over k.
    """
    x = jnp.asarray(x)
    acc = jax.lax.dot_general(
        x, jnp.asarray(w_q).astype(x.dtype), (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32, precision=HIGHEST,
    )
    y = acc * jnp.asarray(w_scale, jnp.float32).reshape(1, -1)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("shape", "blocksize"))
def nf4_dequantize_reference(w_packed, absmax, shape, blocksize: int = NF4_BLOCK_SIZE) -> jax.Array:
    """The float32 [N, K] weight of a bitsandbytes NF4 tensor: level[code] * absmax[block]."""
    n_out, k = shape
    count = n_out * k
    packed = jnp.asarray(w_packed).reshape(-1).astype(jnp.int32)
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)[:count]
    levels = jnp.asarray(NF4_LEVELS)[codes]
    scales = jnp.repeat(jnp.asarray(absmax, jnp.float32).reshape(-1), blocksize)[:count]
    return (levels * scales).reshape(n_out, k)


@functools.partial(jax.jit, static_argnames=("shape", "blocksize", "out_dtype"))
def nf4_matmul_reference(x, w_packed, absmax, *, shape, blocksize: int = NF4_BLOCK_SIZE, bias=None,
                         out_dtype=jnp.float32) -> jax.Array:
    """y = x @ W^T with W the dequantized NF4 weight, cast to x's dtype, float32 accumulation."""
    x = jnp.asarray(x)
    w = nf4_dequantize_reference(w_packed, absmax, shape, blocksize).astype(x.dtype)
    y = jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=HIGHEST
    )
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("group_size",))
def int4_dequantize_reference(w_codes, w_scale, group_size: int | None, w_zero=None) -> jax.Array:
    """The float32 weight [..., N, K] of int4 codes: q[n, k] * scale[n, k // group_size] (scale[n] when None);
    with zero points w_zero (shaped as w_scale): (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]."""
    codes = jnp.asarray(w_codes).astype(jnp.float32)

    def per_code(values):
        values = jnp.asarray(values, jnp.float32).reshape(*codes.shape[:-1], -1)
        return values if group_size is None else jnp.repeat(values, group_size, axis=-1)

    if w_zero is not None:
        codes = codes - per_code(w_zero)
    return codes * per_code(w_scale)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype"))
def int4_weight_matmul_reference(x, w_codes, w_scale, *, group_size: int | None, bias=None,
                                 out_dtype=jnp.float32, w_zero=None) -> jax.Array:
    """W4A16: y = x @ W^T + bias[n], W the int4 weight dequantized in float32 and cast to x's dtype.

    w_codes int8 [N, K] in [-8, 7]; w_scale [N, K/group_size] ([N, 1] per channel
    when group_size is None); w_zero (optional) zero points shaped as w_scale. Accumulation is float32.
    """
    x = jnp.asarray(x)
    w = int4_dequantize_reference(w_codes, w_scale, group_size, w_zero).astype(x.dtype)
    y = jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=HIGHEST
    )
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "group_offset", "transpose_rhs"))
def grouped_matmul_reference(lhs, rhs, group_sizes, *, preferred_element_type=jnp.float32,
                             group_offset: int = 0, transpose_rhs: bool = False, rhs_scale=None) -> jax.Array:
    """out[rows of group g] = lhs[rows of g] @ rhs[g - group_offset]; other rows are 0.

    rhs is [G, K, N] ([G, N, K] with transpose_rhs), float, int8 or fp8 codes; it
    is cast to lhs' dtype (exact for int8 and fp8 codes). With rhs_scale [G, N]
    (per output channel) each group's float32 product is multiplied by its scale.
    Groups outside [group_offset, group_offset + G) and rows past
    sum(group_sizes) give zeros.
    """
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    if transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    m = lhs.shape[0]
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    starts = ends - jnp.asarray(group_sizes, jnp.int32)
    rows = jnp.arange(m)
    out = jnp.zeros((m, rhs.shape[2]), jnp.float32)
    for local in range(rhs.shape[0]):
        g = local + group_offset
        in_group = (rows >= starts[g]) & (rows < ends[g])
        y = jax.lax.dot_general(lhs, rhs[local].astype(lhs.dtype), (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32, precision=HIGHEST)
        if rhs_scale is not None:
            y = y * jnp.asarray(rhs_scale, jnp.float32).reshape(rhs.shape[0], -1)[local][None, :]
        out = jnp.where(in_group[:, None], y, out)
    return out.astype(preferred_element_type)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "group_offset", "num_actual_groups"))
def transposed_grouped_matmul_reference(lhs, rhs, group_sizes, *, preferred_element_type=jnp.float32,
                                        group_offset: int = 0, num_actual_groups: int | None = None) -> jax.Array:
    """out[g] = lhs[:, cols of group g] @ rhs[rows of group g, :]; lhs [K, M], rhs [M, N]."""
    lhs = jnp.asarray(lhs)
    rhs = jnp.asarray(rhs)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    count = sizes.shape[0] - group_offset if num_actual_groups is None else num_actual_groups
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    rows = jnp.arange(rhs.shape[0])
    outs = []
    for local in range(count):
        g = local + group_offset
        in_group = (rows >= starts[g]) & (rows < ends[g])
        masked = jnp.where(in_group[:, None], rhs, jnp.zeros_like(rhs))
        outs.append(jax.lax.dot_general(lhs, masked, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32, precision=HIGHEST))
    return jnp.stack(outs).astype(preferred_element_type)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype"))
def w4a8_fp8_matmul_reference(x, w_codes, w_scale, *, group_size: int | None, bias=None,
                              out_dtype=jnp.float32) -> jax.Array:
    """W4A8-FP8: x rounded to E4M3 per token (scale max|x[m]| / 448, 1 for a zero row; x / scale in float32,
    clamped to +-448, round to nearest even), those values times the int4 weight dequantized in float32,
    float32 accumulation, then * x_scale[m] + bias[n] and one cast.

    w_codes int8 [N, K] in [-8, 7]; w_scale [N, K/group_size] ([N, 1] when group_size is None).
    """
    xf = jnp.asarray(x).astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    x_scale = jnp.where(absmax > 0, f32_quotient(absmax, jnp.float32(448.0)), jnp.float32(1.0))
    x_e4m3 = jnp.clip(f32_quotient(xf, x_scale), -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    w = int4_dequantize_reference(w_codes, w_scale, group_size)
    y = jax.lax.dot_general(
        x_e4m3, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=HIGHEST
    )
    y = y * x_scale
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("group_size",))
def fp4_dequantize_reference(w_codes, w_scale, group_size: int, w_global=None) -> jax.Array:
    """The float32 weight [N, K] of E2M1 codes (uint8 0..15, bit 3 the sign): E2M1[code] times its group's scale
    w_scale[n, k // group_size], divided by the tensor's global scale w_global first where there is one (NVFP4:
    scale / global in float32, as compressed-tensors divides it; MXFP4: the power-of-two scale itself)."""
    scale = jnp.asarray(w_scale, jnp.float32)
    if w_global is not None:
        scale = scale / jnp.asarray(w_global, jnp.float32).reshape(())
    values = jnp.asarray(FP4_LEVELS)[jnp.asarray(w_codes).astype(jnp.int32)]
    return values * jnp.repeat(scale, group_size, axis=-1)


@functools.partial(jax.jit, static_argnames=("group_size", "out_dtype"))
def fp4_weight_matmul_reference(x, w_codes, w_scale, *, group_size: int, w_global=None, bias=None,
                                out_dtype=jnp.float32) -> jax.Array:
    """NVFP4A16 / MXFP4A16: y = x @ W^T + bias[n], W the E2M1 weight dequantized in float32 and cast to x's dtype
    (what a W4A16 dequantizing kernel computes); float32 accumulation."""
    x = jnp.asarray(x)
    w = fp4_dequantize_reference(w_codes, w_scale, group_size, w_global).astype(x.dtype)
    y = jax.lax.dot_general(
        x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=HIGHEST
    )
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "preferred_element_type", "group_offset"))
def fp4_grouped_matmul_reference(lhs, w_codes, w_scale, group_sizes, *, group_size: int, w_global=None,
                                 preferred_element_type=jnp.float32, group_offset: int = 0) -> jax.Array:
    """FP4 experts (NVFP4A16, MXFP4A16): out[rows of group g] = lhs[rows of g] @ W[g - group_offset]^T.

    w_codes uint8 [G, N, K] E2M1 codes, w_scale [G, N, K/group_size], w_global one float32 per expert or None.
    Each expert is dequantized as fp4_dequantize_reference does (its group scale over its own global scale, in
    float32), cast to lhs' dtype, and multiplied with float32 accumulation (grouped_matmul_reference).
    """
    scale = jnp.asarray(w_scale, jnp.float32)
    if w_global is not None:
        scale = scale / jnp.asarray(w_global, jnp.float32).reshape(-1, 1, 1)
    values = jnp.asarray(FP4_LEVELS)[jnp.asarray(w_codes).astype(jnp.int32)]
    weight = values * jnp.repeat(scale, group_size, axis=-1)
    return grouped_matmul_reference(lhs, weight.astype(jnp.asarray(lhs).dtype), group_sizes,
                                    preferred_element_type=preferred_element_type, group_offset=group_offset,
                                    transpose_rhs=True)
