"""GPU prefill variants of the dense quantized matmuls: a pipelined, L2-swizzled Triton kernel, and XLA's own
dequantize-then-dot (or int8 / FP8 dot) for the shapes where the tuning sweep finds XLA faster.

At large M a matmul is compute-bound and each weight tile is read by Mp/tm
programs. The Triton kernel runs a one-axis grid whose program order walks
`group_m` row tiles down one column of tiles before moving right (Triton's
grouped ordering), so the weight tiles a group needs stay in L2 while its
programs run; its K loop is software-pipelined `num_stages` deep (the loads of
later steps issued while the MMA works on the current one) and the epilogue
(x_scale, w_scale, bias, cast) runs in registers. The XLA path decodes the whole
weight to x's dtype once per call with the same arithmetic as the kernels
(reference.py's contract) and hands the product to XLA's dot, as vLLM does
where a dequantizing kernel loses to cuBLAS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from qconvert.kernels.gpu_formats import FORMATS, NT_DIMS, acc_dtype, dot_rows, step_columns, step_pairs
from qconvert.kernels.tiles import Tiling

PREFILL_VARIANTS = ("pipelined", "xla")


def swizzle_group(mt: int, group_m: int) -> int:
    """The largest row-tile group <= group_m that divides the Mp/tm row tiles (1 at worst)."""
    group = max(1, min(group_m, mt))
    while mt % group:
        group -= 1
    return group


def _tile_of(p, mt: int, nt: int, group: int):
    """Program p's (row tile, column tile): `group` row tiles per column before the next column."""
    per_band = group * nt
    band = p // per_band
    return band * group + p % group, (p % per_band) // group


def _pipelined_kernel(*refs, fmt, tk, steps, n_x, has_scales, has_zero, per_channel, columns, acc_type,
                      has_bias):
    x_refs = refs[:n_x]
    at = n_x + 1
    w_ref = refs[n_x]
    s_ref = refs[at] if has_scales else None
    at += has_scales
    z_ref = refs[at] if has_zero else None
    at += has_zero
    xs_ref = refs[at] if fmt.codes_dot else None
    at += fmt.codes_dot
    ws_ref = refs[at] if fmt.channel_scale else None
    at += fmt.channel_scale
    b_ref = refs[at] if has_bias else None
    o_ref = refs[-1]

    def step(k, acc):
        for x, w in step_pairs(fmt, x_refs, w_ref, s_ref, z_ref, k, tk=tk, columns=columns, per_channel=per_channel):
            acc = acc + dot_rows(x, w, acc_type)
        return acc

    y = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, acc_type)).astype(jnp.float32)
    if xs_ref is not None:
        y = y * xs_ref[...]
    if ws_ref is not None:
        y = y * ws_ref[...]
    if b_ref is not None:
        y = y + b_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt_name", "tiling", "group_size", "group_m", "num_warps", "num_stages",
                                             "out_dtype", "interpret"))
def pipelined_matmul(x_parts, w, scales, zero, x_scale, w_scale, bias, *, fmt_name: str, tiling: Tiling,
                     group_size: int | None, out_dtype, group_m: int = 8, num_warps: int = 8, num_stages: int = 4,
                     interpret: bool = False):
    """y [Mp, Np] = epilogue(x . W^T) on padded operands (as gpu_decode.split_partials takes them), plus
    x_scale [Mp, 1] (W8A8), w_scale [1, Np] (per-channel formats) and bias [1, Np], each None where unused."""
    fmt = FORMATS[fmt_name]
    mp, np_ = x_parts[0].shape[0], w.shape[0]
    kp = w.shape[1] * (2 if fmt.packed else 1)
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    mt, nt = mp // tm, np_ // tn
    group = swizzle_group(mt, group_m)

    def rows(width):
        return pl.BlockSpec((tm, width), lambda p: (_tile_of(p, mt, nt, group)[0], 0))

    def cols(width):
        return pl.BlockSpec((tn, width), lambda p: (_tile_of(p, mt, nt, group)[1], 0))

    def col_vec():
        return pl.BlockSpec((1, tn), lambda p: (0, _tile_of(p, mt, nt, group)[1]))

    operands, in_specs = list(x_parts) + [w], [rows(x_parts[0].shape[1])] * len(x_parts) + [cols(w.shape[1])]
    for extra in (scales, zero):
        if extra is not None:
            operands.append(extra)
            in_specs.append(cols(extra.shape[1]))
    if fmt.codes_dot:
        operands.append(x_scale)
        in_specs.append(rows(1))
    if fmt.channel_scale:
        operands.append(w_scale)
        in_specs.append(col_vec())
    if bias is not None:
        operands.append(bias)
        in_specs.append(col_vec())
    per_channel = fmt.column_groups and group_size is None
    kernel = functools.partial(_pipelined_kernel, fmt=fmt, tk=tk, steps=kp // tk, n_x=len(x_parts),
                               has_scales=scales is not None, has_zero=zero is not None, per_channel=per_channel,
                               columns=step_columns(fmt, tk, group_size), acc_type=acc_dtype(fmt, x_parts[0].dtype),
                               has_bias=bias is not None)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype), grid=(mt * nt,), in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda p: _tile_of(p, mt, nt, group)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"_{fmt.name}_pipelined_kernel",
    )(*operands)


def xla_matmul(x, weight, fmt_name: str, x_scale, bias, out_dtype):
    """XLA's own path for a prepared weight (prepared.PreparedWeight): int8 x int8 -> int32 and E4M3 x E4M3 ->
    float32 dots for W8A8, or the weight decoded to x's dtype (prepared.dequantize) and a float32-accumulated
    dot; then the contract's epilogue."""
    from qconvert.kernels.prepared import dequantize

    fmt = FORMATS[fmt_name]
    if fmt.codes_dot:
        acc = jax.lax.dot_general(x, weight.w, NT_DIMS, preferred_element_type=acc_dtype(fmt, x.dtype))
        y = acc.astype(jnp.float32) * jnp.asarray(x_scale, jnp.float32).reshape(-1, 1) * weight.scale
    else:
        y = jax.lax.dot_general(x, dequantize(weight, x.dtype), NT_DIMS, preferred_element_type=jnp.float32,
                                precision=jax.lax.Precision.HIGHEST)
        if fmt.channel_scale:
            y = y * weight.scale
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)
