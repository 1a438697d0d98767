"""GPU (Triton, through Pallas) kernels for the grouped (MoE) matmuls, forward and weight-gradient form.

Forward: grid (M tiles, N tiles). A tile -> group map (the first local group
overlapping each row tile and how many do) lets each program visit the groups of
its rows in turn; for each it walks the whole K axis in an in-kernel loop with a
float32 register accumulator on that expert's weights, and keeps the rows that
belong to the group. Every program writes only its own output tile, so tiles
that straddle a group boundary need no atomics or masked stores, and rows of no
local group come out as exact zeros.

Weight gradient: grid (K tiles, N tiles, local groups); each program loops over
the row chunks of its group, masking the rows of neighbouring groups, so an
empty group runs no iteration and writes zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from qconvert.formats.qarray import NF4_BLOCK_SIZE
from qconvert.kernels.gpu_dense import fp4_step_dot, int4_step_dot, int4_step_scales, nf4_step_dot
from qconvert.kernels.tiles import Tiling, decodes_e2m1, grouped_operands, int4_packed, pad_to, rhs_kind_of, round_up

NN_DIMS = (((1,), (0,)), ((), ()))
NT_DIMS = (((1,), (1,)), ((), ()))
HIGHEST = jax.lax.Precision.HIGHEST


def _compiler_params(tiling: Tiling):
    # Small row tiles are memory-bound decode shapes: fewer warps, deeper pipeline.
    return pltr.CompilerParams(num_warps=4 if tiling.tm <= 32 else 8, num_stages=3)


def _whole(shape):
    """A block that is the whole array (the kernel indexes it with the group it is working on)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def local_group_offsets(group_sizes: jax.Array, start_group: int, num_local: int) -> jax.Array:
    """Row offsets [num_local + 1] of the local groups: local group l owns rows [off[l], off[l+1])."""
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return offsets[start_group:start_group + num_local + 1]


def tile_group_map(local_offsets: jax.Array, mp: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """For each row tile of tm rows: (first local group overlapping it, how many local groups do).

    Groups are contiguous row ranges in order, so the groups overlapping a tile
    form one run. A tile holding only rows past the local groups gets count 0.
    """
    tile_start = jnp.arange(mp // tm, dtype=jnp.int32) * tm
    first = jnp.searchsorted(local_offsets[1:], tile_start, side="right")
    last = jnp.searchsorted(local_offsets[:-1], tile_start + tm, side="left") - 1
    count = jnp.maximum(last - first + 1, 0)
    return first.astype(jnp.int32), count.astype(jnp.int32)


def live_count(count, live) -> jax.Array:
    """count where live, else 0, as an int32 loop bound (an int32 product, never a select)."""
    return jnp.asarray(count, jnp.int32) * live.astype(jnp.int32)


def _gmm_kernel(offsets_ref, first_ref, count_ref, *refs, rhs_kind, transpose_rhs, tiling):
    zero = ()
    if rhs_kind.packs_nibbles:  # int4 with zero points: their ref follows the scales'
        xe_ref, xo_ref, w_ref, a_ref, *zero, o_ref = refs
    elif rhs_kind.channel_scaled:
        x_ref, w_ref, s_ref, o_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    i = pl.program_id(0)
    rows = i * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)

    def k_loop(g):
        if rhs_kind.flat_blocks:
            half, blocks = tk // 2, tk // NF4_BLOCK_SIZE

            def step(k, acc):
                cols = pl.ds(pl.multiple_of(k * half, half), half)
                scales = [a_ref[g, :, pl.ds(k * blocks + b, 1)] for b in range(blocks)]
                return nf4_step_dot(acc, xe_ref[:, cols], xo_ref[:, cols], w_ref[g, :, cols].astype(jnp.int32),
                                    scales)

            return step, w_ref.shape[2] // half

        if int4_packed(rhs_kind):
            half = tk // 2
            steps = w_ref.shape[2] // half
            groups = a_ref.shape[2] // steps  # scale groups per K step (1 for a per-channel scale)
            # FP4 decodes E2M1 by its table (its scales already over the expert's global scale); int4 sign-extends
            step_dot = fp4_step_dot if decodes_e2m1(rhs_kind) else int4_step_dot

            def step(k, acc):
                cols = pl.ds(pl.multiple_of(k * half, half), half)
                return step_dot(acc, xe_ref[:, cols], xo_ref[:, cols], w_ref[g, :, cols].astype(jnp.int32),
                                int4_step_scales(a_ref, k, groups, g),
                                *[int4_step_scales(z_ref, k, groups, g) for z_ref in zero])

            return step, steps

        def step(k, acc):
            cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
            x = x_ref[:, cols]
            w = (w_ref[g, :, cols] if transpose_rhs else w_ref[g, cols, :]).astype(x.dtype)
            return acc + jax.lax.dot_general(x, w, NT_DIMS if transpose_rhs else NN_DIMS,
                                             preferred_element_type=jnp.float32, precision=HIGHEST)

        return step, x_ref.shape[1] // tk

    def visit_group(idx, y):
        g = first_ref[i] + idx
        start, end = offsets_ref[g], offsets_ref[g + 1]
        step, num_k = k_loop(g)
        # An empty group inside the tile's run of groups owns no row: skip its K walk.
        # The bound is built in int32 arithmetic: a select of Python ints lowers to an
        # i1 loop bound, which Triton's verifier refuses ('scf.for' bounds differ in type).
        acc = jax.lax.fori_loop(0, live_count(num_k, end > start), step, jnp.zeros((tm, tn), jnp.float32))
        if rhs_kind.channel_scaled:
            acc = acc * s_ref[pl.ds(g, 1), :]
        return jnp.where((rows >= start) & (rows < end), acc, y)

    y = jax.lax.fori_loop(0, count_ref[i], visit_group, jnp.zeros((tm, tn), jnp.float32))
    o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "rhs_kind", "transpose_rhs", "interpret"))
def grouped_matmul_gpu(local_offsets, tile_first, tile_count, lhs_operands, rhs_operands, *, tiling: Tiling,
                       out_dtype, rhs_kind: str, transpose_rhs: bool, interpret: bool = False):
    """Padded operands. local_offsets [G+1], tile_first/tile_count [Mp/tm] (tile_group_map).

    lhs_operands: (lhs [Mp, Kp],) or, for NF4 and int4, (lhs_even, lhs_odd) [Mp, Kp/2].
    rhs_operands: float/int8/fp8 (rhs [G, Kp, Np] or [G, Np, Kp] transposed,) plus the
    int8 scale [G, Np]; NF4 (bytes [G, Np, Kp/2], absmax [G, Np, Kp/64]); int4
    (bytes [G, Np, Kp/2] i8, scales [G, Np, Kp/group], as int4_weight_operands lays them out); FP4 as int4
    (E2M1 code pairs, each group's float32 scale over its expert's global scale).
    """
    rhs_kind = rhs_kind_of(rhs_kind)
    tm, tn = tiling.tm, tiling.tn
    mp, kp_x = lhs_operands[0].shape
    w = rhs_operands[0]
    num_local = w.shape[0]
    if rhs_kind.packs_nibbles or transpose_rhs:
        np_ = w.shape[1]
        w_spec = pl.BlockSpec((num_local, tn, w.shape[2]), lambda i, j: (0, j, 0))
    else:
        np_ = w.shape[2]
        w_spec = pl.BlockSpec((num_local, w.shape[1], tn), lambda i, j: (0, 0, j))
    in_specs = [_whole(local_offsets.shape), _whole(tile_first.shape), _whole(tile_count.shape)]
    in_specs += [pl.BlockSpec((tm, kp_x), lambda i, j: (i, 0))] * len(lhs_operands) + [w_spec]
    if rhs_kind.packs_nibbles:  # the scales, and int4's zero points laid out as them
        in_specs += [pl.BlockSpec((num_local, tn, rhs_operands[1].shape[2]), lambda i, j: (0, j, 0))] * (
            len(rhs_operands) - 1)
    elif rhs_kind.channel_scaled:
        in_specs.append(pl.BlockSpec((num_local, tn), lambda i, j: (0, j)))
    return pl.pallas_call(
        functools.partial(_gmm_kernel, rhs_kind=rhs_kind, transpose_rhs=transpose_rhs, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // tm, np_ // tn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        compiler_params=_compiler_params(tiling),
        interpret=interpret,
    )(local_offsets, tile_first, tile_count, *lhs_operands, *rhs_operands)


def _tgmm_kernel(offsets_ref, lhs_ref, rhs_ref, o_ref, *, tiling):
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    g = pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]
    first_tile = start // tm
    num_chunks = live_count((end + tm - 1) // tm - first_tile, end > start)

    def step(t, acc):
        row0 = (first_tile + t) * tm
        chunk = pl.ds(pl.multiple_of(row0, tm), tm)
        lhs = lhs_ref[:, chunk]
        rhs = rhs_ref[chunk, :]
        lhs_rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tk, tm), 1)
        rhs_rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        # Both operands are masked so a non-finite value in a neighbouring group cannot leak in as 0 * inf.
        lhs = jnp.where((lhs_rows >= start) & (lhs_rows < end), lhs, jnp.zeros_like(lhs))
        rhs = jnp.where((rhs_rows >= start) & (rhs_rows < end), rhs, jnp.zeros_like(rhs))
        dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
        return acc + jax.lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), NN_DIMS,
                                         preferred_element_type=jnp.float32, precision=HIGHEST)

    acc = jax.lax.fori_loop(0, num_chunks, step, jnp.zeros((tk, tn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "interpret"))
def transposed_grouped_matmul_gpu(local_offsets, lhs, rhs, *, tiling: Tiling, out_dtype, interpret: bool = False):
    """Padded operands: local_offsets [G+1], lhs [Kp, Mp], rhs [Mp, Np]; out [G, Kp, Np]."""
    tk, tn = tiling.tk, tiling.tn
    kp, mp = lhs.shape
    np_ = rhs.shape[1]
    num_local = local_offsets.shape[0] - 1
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((num_local, kp, np_), out_dtype),
        grid=(kp // tk, np_ // tn, num_local),
        in_specs=[_whole(local_offsets.shape),
                  pl.BlockSpec((tk, mp), lambda kk, j, g: (kk, 0)),
                  pl.BlockSpec((mp, tn), lambda kk, j, g: (0, j))],
        out_specs=pl.BlockSpec((None, tk, tn), lambda kk, j, g: (g, kk, j)),
        compiler_params=_compiler_params(tiling),
        interpret=interpret,
    )(local_offsets, lhs, rhs)


def run_grouped_matmul(lhs, rhs_kind: str, rhs_data, rhs_aux, group_sizes, *, offset: int, num_local: int, n: int,
                       tiling: Tiling, out_dtype, transpose_rhs: bool, group_size: int | None = None,
                       rhs_zero=None) -> jax.Array:
    """Lay out checked grouped_matmul operands for the Triton kernel, launch it, return [M, N].

    rhs_data/rhs_aux as grouped.py's _rhs_parts gives them (float or int8 rhs and
    the int8 scale [G, N]; NF4 bytes and float32 absmax, flat; or int4 codes
    [G, N, K] and float32 scales [G, N, K/group_size], [G, N, 1] per channel, with rhs_zero the zero points
    shaped as the scales or None; or FP4's uint8 E2M1 codes [G, N, K] and float32 scales [G, N, K/group_size]).
    """
    rhs_kind = rhs_kind_of(rhs_kind)
    m, k = lhs.shape
    mp, np_ = round_up(m, tiling.tm), round_up(n, tiling.tn)
    kp = round_up(k, tiling.tk)
    local_offsets = local_group_offsets(group_sizes, offset, num_local)
    tile_first, tile_count = tile_group_map(local_offsets, mp, tiling.tm)
    lhs_ops, rhs_ops = grouped_operands(pad_to(lhs, (mp, kp)), rhs_kind, rhs_data, rhs_aux, rhs_zero,
                                        num_local=num_local, n=n, k=k, np_=np_, kp=kp, tk=tiling.tk,
                                        group_size=group_size, transpose_rhs=transpose_rhs, tpu_layout=False)
    y = grouped_matmul_gpu(local_offsets, tile_first, tile_count, lhs_ops, rhs_ops, tiling=tiling,
                           out_dtype=jnp.dtype(out_dtype), rhs_kind=rhs_kind, transpose_rhs=transpose_rhs)
    return y[:m, :n]


def run_transposed_grouped_matmul(lhs, rhs, group_sizes, *, offset: int, num_local: int, tiling: Tiling,
                                  out_dtype) -> jax.Array:
    """Pad checked transposed_grouped_matmul operands (lhs [K, M], rhs [M, N]), launch, return [G, K, N]."""
    k, m = lhs.shape
    n = rhs.shape[1]
    mp, kp, np_ = round_up(m, tiling.tm), round_up(k, tiling.tk), round_up(n, tiling.tn)
    y = transposed_grouped_matmul_gpu(local_group_offsets(group_sizes, offset, num_local), pad_to(lhs, (kp, mp)),
                                      pad_to(rhs, (mp, np_)), tiling=tiling, out_dtype=jnp.dtype(out_dtype))
    return y[:, :k, :n]
