"""TPU (Mosaic) Pallas kernels for the grouped (MoE) matmuls, forward and weight-gradient form.

The group metadata (make_group_metadata) is scalar-prefetched into SMEM so the
block index maps can pick, at each grid step, the row tile and the expert's
weight block. Operands arrive padded to whole tiles from grouped.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qconvert.kernels.tiles import Tiling, decodes_e2m1, int4_packed, rhs_kind_of
from qconvert.kernels.tpu_dense import fp4_tile_dot, int4_tile_dot, nf4_tile_dot

NN_DIMS = (((1,), (0,)), ((), ()))
NT_DIMS = (((1,), (1,)), ((), ()))
HIGHEST = jax.lax.Precision.HIGHEST


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _local_group(group_ids, step, group_offset, num_local):
    return jnp.clip(group_ids[step] - group_offset[0], 0, num_local - 1)


def _row_mask(shape, axis, tm, m_tile, start, end):
    rows = m_tile * tm + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    return (rows >= start) & (rows < end)


def _gmm_kernel(group_offsets, group_ids, m_tile_ids, group_offset, num_tiles, *refs, rhs_kind, transpose_rhs,
                tm):
    z_ref = None
    if rhs_kind.packs_nibbles:  # int4 with zero points: their ref follows the scales'
        xe_ref, xo_ref, w_ref, a_ref, *zero, o_ref, acc_ref = refs
        z_ref = zero[0] if zero else None
    elif rhs_kind.channel_scaled:
        x_ref, w_ref, s_ref, o_ref, acc_ref = refs
    else:
        x_ref, w_ref, o_ref, acc_ref = refs
    step, k = pl.program_id(1), pl.program_id(2)
    live = step < num_tiles[0]

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _accumulate():
        if rhs_kind.flat_blocks:
            acc_ref[...] = nf4_tile_dot(acc_ref[...], xe_ref, xo_ref, w_ref, a_ref)
        elif decodes_e2m1(rhs_kind):  # E2M1 by its table, times the group scale over the expert's global one
            acc_ref[...] = fp4_tile_dot(acc_ref[...], xe_ref, xo_ref, w_ref, a_ref)
        elif rhs_kind.column_groups:
            acc_ref[...] = int4_tile_dot(acc_ref[...], xe_ref, xo_ref, w_ref, a_ref, z_ref)
        else:
            x = x_ref[...]
            w = w_ref[...].astype(x.dtype)
            acc_ref[...] += jax.lax.dot_general(x, w, NT_DIMS if transpose_rhs else NN_DIMS,
                                                preferred_element_type=jnp.float32, precision=HIGHEST)

    @pl.when(live & (k == pl.num_programs(2) - 1))
    def _store():
        g = group_ids[step]
        mask = _row_mask(o_ref.shape, 0, tm, m_tile_ids[step], group_offsets[g], group_offsets[g + 1])
        y = acc_ref[...]
        if rhs_kind.channel_scaled:
            y = y * s_ref[...]
        # Rows of other groups in a shared tile keep what their own visit wrote.
        o_ref[...] = jnp.where(mask, y.astype(o_ref.dtype), o_ref[...])


def _gmm_in_specs(rhs_kind, tiling: Tiling, transpose_rhs: bool, num_local: int, int4_groups: int) -> list:
    """grouped_matmul_tpu's input BlockSpecs: lhs tiles by the row tile's id; the rhs (and its scales) of the
    tile's group, local to the shard."""
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn

    def lhs_map(n, i, k, go, gi, mt, goff, nt):
        return mt[i], k

    def rhs_map(n, i, k, go, gi, mt, goff, nt):
        g = _local_group(gi, i, goff, num_local)
        return (g, n, k) if (transpose_rhs or rhs_kind.packs_nibbles) else (g, k, n)

    def scale_map(n, i, k, go, gi, mt, goff, nt):
        return _local_group(gi, i, goff, num_local), 0, n

    def int4_scale_map(n, i, k, go, gi, mt, goff, nt):
        return _local_group(gi, i, goff, num_local), k, n, 0

    if rhs_kind.flat_blocks:
        return [pl.BlockSpec((tm, tk // 2), lhs_map)] * 2 + [
            pl.BlockSpec((None, tn, tk // 2), rhs_map), pl.BlockSpec((None, tn, tk // 64), rhs_map)]
    if int4_packed(rhs_kind):
        return [pl.BlockSpec((tm, tk // 2), lhs_map)] * 2 + [
            pl.BlockSpec((None, tn, tk // 2), rhs_map),
            pl.BlockSpec((None, None, tn, int4_groups), int4_scale_map)]
    block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    in_specs = [pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(block, rhs_map)]
    if rhs_kind.channel_scaled:
        in_specs.append(pl.BlockSpec((None, 1, tn), scale_map))
    return in_specs


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "rhs_kind", "transpose_rhs", "interpret"))
def grouped_matmul_tpu(metadata, group_offset, num_tiles, lhs_operands, rhs_operands, *, tiling: Tiling, out_dtype,
                       rhs_kind: str, transpose_rhs: bool, interpret: bool):
    """Padded operands. lhs_operands: (lhs [Mp, Kp],) or, for NF4 and int4, (lhs_even, lhs_odd) [Mp, Kp/2].
    rhs_operands: float/int8/fp8 (rhs [G, Kp, Np] or [G, Np, Kp] transposed,) plus int8/fp8 scale [G, 1, Np];
    NF4 (bytes [G, Np, Kp/2], absmax [G, Np, Kp/64]); int4 (bytes [G, Np, Kp/2] i8, scales
    [G, Kp/tk, Np, groups per K tile], as int4_weight_operands lays them out, and optionally the zero points
    laid out as the scales); FP4 as int4 without zero points (E2M1 code pairs, and each group's float32 scale
    over its expert's global scale)."""
    rhs_kind = rhs_kind_of(rhs_kind)
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    group_offsets, group_ids, m_tile_ids = metadata
    mp = lhs_operands[0].shape[0]
    num_local = rhs_operands[0].shape[0]
    if rhs_kind.packs_nibbles:
        np_, kp = rhs_operands[0].shape[1], 2 * rhs_operands[0].shape[2]
    elif transpose_rhs:
        np_, kp = rhs_operands[0].shape[1:]
    else:
        kp, np_ = rhs_operands[0].shape[1:]
    grid = (np_ // tn, group_ids.shape[0], kp // tk)
    in_specs = _gmm_in_specs(rhs_kind, tiling, transpose_rhs, num_local,
                             rhs_operands[1].shape[3] if int4_packed(rhs_kind) else 0)
    in_specs += in_specs[-1:] * (len(rhs_operands) - 2 if int4_packed(rhs_kind) else 0)  # zero points: as scales
    return pl.pallas_call(
        functools.partial(_gmm_kernel, rhs_kind=rhs_kind, transpose_rhs=transpose_rhs, tm=tm),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=grid, in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), lambda n, i, k, go, gi, mt, goff, nt: (mt[i], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret(interpret),
    )(group_offsets, group_ids, m_tile_ids, group_offset, num_tiles, *lhs_operands, *rhs_operands)


def _tgmm_kernel(group_offsets, group_ids, m_tile_ids, group_offset, num_tiles, lhs_ref, rhs_ref, o_ref, acc_ref,
                 *, tm):
    step = pl.program_id(2)
    last_step = pl.num_programs(2) - 1
    g = group_ids[step]
    live = step < num_tiles[0]
    first_of_group = (step == 0) | (group_ids[jnp.maximum(step - 1, 0)] != g)
    last_of_group = (step == num_tiles[0] - 1) | (group_ids[jnp.minimum(step + 1, last_step)] != g)

    @pl.when(live & first_of_group)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _accumulate():
        start, end = group_offsets[g], group_offsets[g + 1]
        lhs = lhs_ref[...]
        rhs = rhs_ref[...]
        lhs = jnp.where(_row_mask(lhs.shape, 1, tm, m_tile_ids[step], start, end), lhs, jnp.zeros_like(lhs))
        rhs = jnp.where(_row_mask(rhs.shape, 0, tm, m_tile_ids[step], start, end), rhs, jnp.zeros_like(rhs))
        acc_ref[...] += jax.lax.dot_general(lhs, rhs, NN_DIMS, preferred_element_type=jnp.float32,
                                            precision=HIGHEST)

    @pl.when(live & last_of_group)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "num_local", "interpret"))
def transposed_grouped_matmul_tpu(metadata, group_offset, num_tiles, lhs, rhs, *, tiling: Tiling, out_dtype,
                                  num_local: int, interpret: bool):
    """Padded operands: lhs [Kp, Mp], rhs [Mp, Np]; out [num_local, Kp, Np]."""
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    group_offsets, group_ids, m_tile_ids = metadata
    kp, _ = lhs.shape
    np_ = rhs.shape[1]

    def out_map(kk, n, i, go, gi, mt, goff, nt):
        return _local_group(gi, i, goff, num_local), kk, n

    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((num_local, kp, np_), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(kp // tk, np_ // tn, group_ids.shape[0]),
            in_specs=[pl.BlockSpec((tk, tm), lambda kk, n, i, go, gi, mt, goff, nt: (kk, mt[i])),
                      pl.BlockSpec((tm, tn), lambda kk, n, i, go, gi, mt, goff, nt: (mt[i], n))],
            out_specs=pl.BlockSpec((None, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
    )(group_offsets, group_ids, m_tile_ids, group_offset, num_tiles, lhs, rhs)
