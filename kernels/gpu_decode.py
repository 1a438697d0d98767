"""GPU (Triton, through Pallas) decode and small-M variants of the dense quantized matmuls: split-K, swap-AB
and a CUDA-core GEMV, for every weight format of gpu_formats.

At M <= 16 a matmul is a weight stream: the plain tiled kernel has only
N/tn programs (32 at N = 1024, tn = 32), too few to keep every SM reading.
Split-K cuts K into `split` ranges, one program each, so the grid has
M/tm x N/tn x split programs; each writes its float32 (int32 for W8A8 int8)
partial sum, and XLA sums the partials (exactly, for int32) and applies the
epilogue (x_scale, w_scale, bias, cast) in the contract's order. Swap-AB runs
the same walk with the weight tile as the dot's left operand, so tn (64 or
more) maps onto the MMA's wide side and the few rows of x onto its narrow
side. GEMV gives each row of x its own programs and multiplies on the CUDA
cores (a broadcast product summed over K), with no MMA padding of M to 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from qconvert.kernels.gpu_formats import FORMATS, acc_dtype, dot_cols, dot_rows, gemv_rows, step_columns, step_pairs
from qconvert.kernels.tiles import Tiling

DECODE_VARIANTS = ("splitk", "swapab", "gemv")


def _split_kernel(*refs, fmt, tk, steps, n_x, has_scales, has_zero, per_channel, columns, mode, acc_type):
    x_refs = refs[:n_x]
    w_ref = refs[n_x]
    s_ref = refs[n_x + 1] if has_scales else None
    z_ref = refs[n_x + 2] if has_zero else None
    o_ref = refs[-1]
    first = pl.program_id(2) * steps

    def step(k, acc):
        for x, w in step_pairs(fmt, x_refs, w_ref, s_ref, z_ref, first + k, tk=tk, columns=columns,
                               per_channel=per_channel):
            acc = acc + (dot_cols(x, w, acc_type) if mode == "swapab" else
                         gemv_rows(x, w, acc_type) if mode == "gemv" else dot_rows(x, w, acc_type))
        return acc

    shape = (o_ref.shape[1],) if mode == "gemv" else o_ref.shape
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(shape, acc_type))
    if mode == "gemv":
        o_ref[0, :] = acc
    else:
        o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("fmt_name", "tiling", "split", "mode", "group_size", "num_warps",
                                             "num_stages", "interpret"))
def split_partials(x_parts, w, scales, zero, *, fmt_name: str, tiling: Tiling, split: int, mode: str,
                   group_size: int | None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """The partial sums [split, Mp, Np] (acc dtype) of x . W^T over `split` K ranges.

    x_parts: (x [Mp, Kp],) or, packed formats, (x_even, x_odd) [Mp, Kp/2];
    w [Np, Kp] codes or [Np, Kp/2] bytes; scales [Np, columns] (NF4 absmax,
    int4 group scales, [Np, 1] per channel) or None; zero like scales (int4)
    or None. Kp/tk must be a multiple of split. mode: "splitk" (rows on the
    dot's M side), "swapab" (the weight tile on the M side) or "gemv" (tm = 1,
    CUDA cores).
    """
    fmt = FORMATS[fmt_name]
    mp = x_parts[0].shape[0]
    np_ = w.shape[0]
    kp = w.shape[1] * (2 if fmt.packed else 1)
    tm = 1 if mode == "gemv" else tiling.tm
    tk, tn = tiling.tk, tiling.tn
    steps = kp // tk // split
    acc_type = acc_dtype(fmt, x_parts[0].dtype)
    mt, nt = mp // tm, np_ // tn
    per_channel = fmt.column_groups and group_size is None
    operands = list(x_parts) + [w]
    if mode == "swapab":
        grid = (nt, mt, split)
        x_spec = pl.BlockSpec((tm, x_parts[0].shape[1]), lambda j, i, s: (i, 0))
        row_spec = lambda width: pl.BlockSpec((tn, width), lambda j, i, s: (j, 0))  # noqa: E731
        out_spec = pl.BlockSpec((tn, tm), lambda j, i, s: (s * nt + j, i))
        out_shape = (split * np_, mp)
    else:
        grid = (mt, nt, split)
        x_spec = pl.BlockSpec((tm, x_parts[0].shape[1]), lambda i, j, s: (i, 0))
        row_spec = lambda width: pl.BlockSpec((tn, width), lambda i, j, s: (j, 0))  # noqa: E731
        out_spec = pl.BlockSpec((tm, tn), lambda i, j, s: (s * mt + i, j))
        out_shape = (split * mp, np_)
    in_specs = [x_spec] * len(x_parts) + [row_spec(w.shape[1])]
    for extra in (scales, zero):
        if extra is not None:
            operands.append(extra)
            in_specs.append(row_spec(extra.shape[1]))
    kernel = functools.partial(_split_kernel, fmt=fmt, tk=tk, steps=steps, n_x=len(x_parts),
                               has_scales=scales is not None, has_zero=zero is not None, per_channel=per_channel,
                               columns=step_columns(fmt, tk, group_size), mode=mode, acc_type=acc_type)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(out_shape, acc_type), grid=grid, in_specs=in_specs,
        out_specs=out_spec, compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"_{fmt.name}_{mode}_kernel",
    )(*operands)
    if mode == "swapab":
        return jnp.swapaxes(out.reshape(split, np_, mp), 1, 2)
    return out.reshape(split, mp, np_)


def epilogue(partials, fmt_name: str, x_scale, w_scale, bias, out_dtype):
    """Sum the K ranges' partials and rescale in the contract's order: acc (int32 summed exactly) -> float32,
    * x_scale[m] (W8A8), * w_scale[n] (per-channel formats), + bias[n], one cast."""
    fmt = FORMATS[fmt_name]
    y = jnp.sum(partials, axis=0).astype(jnp.float32)
    if fmt.codes_dot:
        y = y * x_scale
    if fmt.channel_scale:
        y = y * w_scale
    if bias is not None:
        y = y + bias
    return y.astype(out_dtype)
