"""GPU (Triton, through Pallas) decode variant of the grouped (MoE) matmul: one row per program, split-K, on the
CUDA cores.

At decode an MoE layer's rows are a few tokens times top-k experts, most
experts holding one row or none. gpu_grouped's kernel gives each 16-row tile
one program per N block, which walks every expert of its rows in turn: few
programs, each reading several experts' weights one after another. Here every
row has its own programs (grid rows x N/tn x split): each reads its expert's
weight tile once per K step (decoded in registers by gpu_formats, as the dense
variants do) and multiplies it by its row on the CUDA cores, so the experts'
weights stream through every SM at once. XLA sums the K ranges' partials and
applies the per-channel scale of each row's expert after the sum, as the
contract says; rows of no local expert are exact zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from qconvert.formats.qarray import NF4_BLOCK_SIZE
from qconvert.kernels.gpu_formats import FORMATS, gemv_rows, step_pairs
from qconvert.kernels.gpu_grouped import live_count, local_group_offsets
from qconvert.kernels.tiles import (Tiling, decodes_e2m1, int4_packed, int4_weight_operands, rhs_kind_of, round_up,
                                    split_even_odd_columns)


def row_experts(group_sizes, offset: int, num_local: int, m: int) -> jax.Array:
    """The local expert (0 .. num_local - 1) of each of the m rows sorted by expert; -1 for rows of none."""
    offsets = local_group_offsets(group_sizes, offset, num_local)
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.searchsorted(offsets[1:], rows, side="right").astype(jnp.int32)
    return jnp.where((rows >= offsets[0]) & (rows < offsets[-1]), expert, -1)


def _kernel(e_ref, *refs, fmt, tk, steps, n_x, has_scales, columns):
    x_refs, w_ref = refs[:n_x], refs[n_x]
    s_ref = refs[n_x + 1] if has_scales else None
    o_ref = refs[-1]
    expert = e_ref[pl.program_id(0)]
    g = jnp.maximum(expert, 0)
    first = pl.program_id(2) * steps

    def step(k, acc):
        for x, w in step_pairs(fmt, x_refs, w_ref, s_ref, None, first + k, tk=tk, columns=columns,
                               per_channel=False, g=g):
            acc = acc + gemv_rows(x, w, jnp.float32)
        return acc

    # A row of no local expert runs no K step and writes zeros (int32 bound: see gpu_grouped.live_count).
    o_ref[0, :] = jax.lax.fori_loop(0, live_count(steps, expert >= 0), step, jnp.zeros((o_ref.shape[1],),
                                                                                         jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt_name", "tiling", "split", "num_warps", "num_stages", "interpret"))
def grouped_gemv_partials(experts, x_parts, w, scales, *, fmt_name: str, tiling: Tiling, split: int,
                          num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """Partial sums [split, M, Np] float32 of each row times its expert's W^T over `split` K ranges.

    experts [M] (row_experts); x_parts (x [M, Kp],) or (x_even, x_odd) [M, Kp/2];
    w [G, Np, Kp] codes or floats, or [G, Np, Kp/2] bytes; scales [G, Np, columns]
    (NF4 absmax, int4 group scales: a whole number of columns per K step) or None.
    """
    fmt = FORMATS[fmt_name]
    m, np_ = x_parts[0].shape[0], w.shape[1]
    kp = w.shape[2] * (2 if fmt.packed else 1)
    tk, tn = tiling.tk, tiling.tn
    steps = kp // tk // split
    nt = np_ // tn
    operands = [experts, *x_parts, w]
    in_specs = [pl.BlockSpec(experts.shape, lambda r, j, s: (0,))]
    in_specs += [pl.BlockSpec((1, x_parts[0].shape[1]), lambda r, j, s: (r, 0))] * len(x_parts)
    in_specs.append(pl.BlockSpec((w.shape[0], tn, w.shape[2]), lambda r, j, s: (0, j, 0)))
    if scales is not None:
        operands.append(scales)
        in_specs.append(pl.BlockSpec((w.shape[0], tn, scales.shape[2]), lambda r, j, s: (0, j, 0)))
    kernel = functools.partial(_kernel, fmt=fmt, tk=tk, steps=steps, n_x=len(x_parts), has_scales=scales is not None,
                               columns=0 if scales is None else scales.shape[2] // (kp // tk))
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((split * m, np_), jnp.float32), grid=(m, nt, split),
        in_specs=in_specs, out_specs=pl.BlockSpec((1, tn), lambda r, j, s: (s * m + r, j)),
        compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"_grouped_{fmt.name}_gemv_kernel",
    )(*operands)
    return out.reshape(split, m, np_)


def run_grouped_gemv(lhs, rhs_kind: str, rhs_data, rhs_aux, group_sizes, *, offset: int, num_local: int, n: int,
                     tiling: Tiling, split: int, out_dtype, group_size: int | None = None, num_warps: int = 4,
                     num_stages: int = 3) -> jax.Array:
    """grouped_matmul's rows times their experts' W^T (rhs [G, N, K], grouped.py's _rhs_parts) -> [M, N]."""
    rhs_kind = rhs_kind_of(rhs_kind)
    m, k = lhs.shape
    kp, np_ = round_up(k, tiling.tk), round_up(n, tiling.tn)
    lhs_p = jnp.pad(lhs, ((0, 0), (0, kp - k))) if kp != k else lhs
    scales = None
    if rhs_kind.flat_blocks:
        fmt_name, x_parts = "nf4", split_even_odd_columns(lhs_p)
        w = jnp.asarray(rhs_data).reshape(num_local, n, k // 2)
        scales = jnp.asarray(rhs_aux, jnp.float32).reshape(num_local, n, k // NF4_BLOCK_SIZE)
        w, scales = _pad3(w, np_, kp // 2), _pad3(scales, np_, kp // NF4_BLOCK_SIZE)
    elif int4_packed(rhs_kind):  # int4, and FP4's E2M1 codes with their scales over each expert's global one
        fmt_name, x_parts = "fp4" if decodes_e2m1(rhs_kind) else "int4", split_even_odd_columns(lhs_p)
        w, scales = int4_weight_operands(rhs_data, rhs_aux, group_size, np_, kp, tiling.tk, tpu_layout=False)
    else:
        # float, int8 and E4M3 codes are cast exactly to the rows' dtype; a code's scale comes after the sum.
        fmt_name, x_parts = "w8a16", (lhs_p,)
        w = _pad3(jnp.asarray(rhs_data), np_, kp)
    experts = row_experts(group_sizes, offset, num_local, m)
    partials = grouped_gemv_partials(experts, x_parts, w, scales, fmt_name=fmt_name, tiling=tiling, split=split,
                                     num_warps=num_warps, num_stages=num_stages)
    y = jnp.sum(partials, axis=0)[:, :n]
    if rhs_kind.channel_scaled:
        y = y * jnp.asarray(rhs_aux, jnp.float32).reshape(num_local, n)[jnp.maximum(experts, 0)]
    return jnp.where((experts >= 0)[:, None], y, 0.0).astype(out_dtype)


def _pad3(a: jax.Array, rows: int, cols: int) -> jax.Array:
    """Pad the last two axes of [G, R, C] to [G, rows, cols] (no copy when already that shape)."""
    if a.shape[1:] == (rows, cols):
        return a
    return jnp.pad(a, ((0, 0), (0, rows - a.shape[1]), (0, cols - a.shape[2])))
