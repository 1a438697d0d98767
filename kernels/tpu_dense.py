"""TPU (Mosaic) Pallas kernels for the dense quantized matmuls: W8A8 (int8, fp8), W8A16, NF4 and int4 (W4A16).

Grid (M tiles, N tiles, K tiles), K innermost and "arbitrary" so the float32 or
int32 accumulator stays in VMEM scratch across it; the rescale runs once, on the
last K step. Operands are padded with zeros to whole tiles by the callers in
dense.py (zero codes and zero activations add nothing to any sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qconvert.kernels.tiles import Tiling, fp4_nibbles, group_scale_columns, int4_nibbles, nf4_level

NT_DIMS = (((1,), (1,)), ((), ()))  # contract the last axis of both: x [m, k] . w [n, k]
HIGHEST = jax.lax.Precision.HIGHEST
# Bytes of packed NF4 codes decoded at a time: two lane-widths, eight 64-blocks.
NF4_CHUNK_BYTES = 256


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def _interpret(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _row_vec(tiling: Tiling):
    return pl.BlockSpec((tiling.tm, 1), lambda i, j, k: (i, 0))


def _col_vec(tiling: Tiling):
    return pl.BlockSpec((1, tiling.tn), lambda i, j, k: (0, j))


def _launch(kernel, operands, in_specs, *, tiling: Tiling, mp: int, np_: int, kp: int, out_dtype, acc_dtype,
            interpret: bool, name: str | None = None):
    """The pallas_call of every dense kernel: grid (Mp/tm, Np/tn, Kp/tk), a [tm, tn] output block and a [tm, tn]
    accumulator of acc_dtype in VMEM scratch; `in_specs` are the operands' blocks, `name` the kernel's name in
    the lowered module and in profiles (the kernel function's own by default)."""
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0, grid=(mp // tm, np_ // tn, kp // tk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((tm, tn), acc_dtype)]),
        compiler_params=_compiler_params(),
        interpret=_interpret(interpret),
        name=name,
    )(*operands)


def _w8a8_kernel(x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, acc_ref, *, has_bias):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x, w = x_ref[...], w_ref[...]
    if not jnp.issubdtype(x.dtype, jnp.integer):
        # The MXU (before v7) has no fp8 inputs; bf16 holds every E4M3 value exactly (its 8 exponent bits cover
        # E4M3's range, its 8 significant bits E4M3's 4), and bf16 x bf16 products are exact in the f32 accumulator.
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    acc_ref[...] += jax.lax.dot_general(x, w, NT_DIMS, preferred_element_type=acc_ref.dtype)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _rescale():
        y = acc_ref[...].astype(jnp.float32) * xs_ref[...]
        y = y * ws_ref[...]
        if has_bias:
            y = y + b_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


def _w8a8_call(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool, interpret: bool):
    # int8 operands accumulate exactly in an int32 scratch, E4M3 ones (widened to bf16) in a float32 one.
    acc_dtype = jnp.int32 if jnp.issubdtype(x_q.dtype, jnp.integer) else jnp.float32
    (mp, kp), np_ = x_q.shape, w_q.shape[0]
    return _launch(functools.partial(_w8a8_kernel, has_bias=has_bias), (x_q, w_q, x_scale, w_scale, bias),
                   [pl.BlockSpec((tiling.tm, tiling.tk), lambda i, j, k: (i, k)),
                    pl.BlockSpec((tiling.tn, tiling.tk), lambda i, j, k: (j, k)),
                    _row_vec(tiling), _col_vec(tiling), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, kp=kp, out_dtype=out_dtype, acc_dtype=acc_dtype,
                   interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int8_matmul_tpu(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                    interpret: bool):
    """Padded operands: x_q [Mp, Kp] i8, w_q [Np, Kp] i8, x_scale [Mp, 1], w_scale/bias [1, Np] f32."""
    return _w8a8_call(x_q, w_q, x_scale, w_scale, bias, tiling=tiling, out_dtype=out_dtype, has_bias=has_bias,
                      interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def fp8_matmul_tpu(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                   interpret: bool):
    """Padded operands: x_q [Mp, Kp] and w_q [Np, Kp] float8_e4m3fn, x_scale [Mp, 1], w_scale/bias [1, Np] f32."""
    return _w8a8_call(x_q, w_q, x_scale, w_scale, bias, tiling=tiling, out_dtype=out_dtype, has_bias=has_bias,
                      interpret=interpret)


def _w8a16_kernel(x_ref, w_ref, ws_ref, b_ref, o_ref, acc_ref, *, has_bias):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    # int8 codes are exact in every float dtype, so the cast is the whole dequantize;
    # the per-channel scale is applied once, after the sum.
    acc_ref[...] += jax.lax.dot_general(x, w_ref[...].astype(x.dtype), NT_DIMS,
                                        preferred_element_type=jnp.float32, precision=HIGHEST)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _rescale():
        y = acc_ref[...] * ws_ref[...]
        if has_bias:
            y = y + b_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int8_weight_matmul_tpu(x, w_q, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool, interpret: bool):
    """Padded operands: x [Mp, Kp] float, w_q [Np, Kp] i8, w_scale/bias [1, Np] f32."""
    (mp, kp), np_ = x.shape, w_q.shape[0]
    return _launch(functools.partial(_w8a16_kernel, has_bias=has_bias), (x, w_q, w_scale, bias),
                   [pl.BlockSpec((tiling.tm, tiling.tk), lambda i, j, k: (i, k)),
                    pl.BlockSpec((tiling.tn, tiling.tk), lambda i, j, k: (j, k)),
                    _col_vec(tiling), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, kp=kp, out_dtype=out_dtype, acc_dtype=jnp.float32,
                   interpret=interpret)


def expand_block_scales(absmax_chunk: jax.Array, lane_block: jax.Array) -> jax.Array:
    """[tn, blocks] absmax -> [tn, blocks * 32]: each byte column gets its 64-block's absmax.

    A select per block over a lane-index map (a broadcast of one column each),
    which the TPU lowers without any relayout or gather.
    """
    scale = jnp.broadcast_to(absmax_chunk[:, 0:1], lane_block.shape)
    for b in range(1, absmax_chunk.shape[1]):
        scale = jnp.where(lane_block == b, absmax_chunk[:, b:b + 1], scale)
    return scale


def nf4_tile_dot(acc, xe_ref, xo_ref, w_ref, a_ref):
    """acc + one tile's products: packed NF4 bytes w_ref [tn, tile_bytes] with absmax a_ref [tn, tile_bytes/32].

    High nibbles meet xe_ref, low nibbles xo_ref. Codes decode with the exact
    table times the block absmax in float32, cast to the activation dtype; both
    products accumulate in float32.
    """
    tn, tile_bytes = w_ref.shape
    compute_dtype = xe_ref.dtype
    # Decode a chunk at a time so the float weight planes in VMEM stay small. The
    # chunks must cover the whole tile: a tile of an odd number of 128-byte lane
    # widths (tk = 768, 1280, ...: K = 576, 640, 768, 2816, 4864) ends in a
    # half-size chunk, which a whole-chunk count would silently drop.
    for start, width in nf4_chunks(tile_bytes):
        cols = slice(start, start + width)
        # A shift, not //: floor division lowers through sign(), whose TPU lowering
        # needs the chip at hand; the shift is cheaper and lowers anywhere.
        lane_block = jax.lax.broadcasted_iota(jnp.int32, (tn, width), 1) >> 5
        packed = w_ref[:, cols].astype(jnp.int32)
        scale = expand_block_scales(a_ref[:, start // 32:(start + width) // 32], lane_block)
        w_high = (nf4_level(packed >> 4) * scale).astype(compute_dtype)
        w_low = (nf4_level(packed & 0xF) * scale).astype(compute_dtype)
        acc += jax.lax.dot_general(xe_ref[:, cols], w_high, NT_DIMS,
                                   preferred_element_type=jnp.float32, precision=HIGHEST)
        acc += jax.lax.dot_general(xo_ref[:, cols], w_low, NT_DIMS,
                                   preferred_element_type=jnp.float32, precision=HIGHEST)
    return acc


def nf4_chunks(tile_bytes: int) -> list[tuple[int, int]]:
    """(first byte, width) of each decode chunk of a tile: NF4_CHUNK_BYTES each, the rest in the last one.

    Together they cover [0, tile_bytes) exactly once, whatever tile_bytes is.
    """
    return [(start, min(NF4_CHUNK_BYTES, tile_bytes - start)) for start in range(0, tile_bytes, NF4_CHUNK_BYTES)]


def _packed4_kernel(xe_ref, xo_ref, w_ref, s_ref, *refs, tile_dot, has_bias, has_zero=False):
    """NF4 and int4: two codes a byte, x split into even and odd columns; tile_dot decodes and multiplies a tile
    (int4 with zero points: their ref follows the scales')."""
    z_ref, (b_ref, o_ref, acc_ref) = (refs[0] if has_zero else None), refs[-3:]

    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if has_zero:
        acc_ref[...] = tile_dot(acc_ref[...], xe_ref, xo_ref, w_ref, s_ref, z_ref)
    else:
        acc_ref[...] = tile_dot(acc_ref[...], xe_ref, xo_ref, w_ref, s_ref)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        y = acc_ref[...]
        if has_bias:
            y = y + b_ref[...]
        o_ref[...] = y.astype(o_ref.dtype)


def _packed4_call(name, tile_dot, scale_spec, x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype,
                  has_bias: bool, interpret: bool, zeros=None):
    # K tiles of tk codes are tk/2 bytes; scale_spec is the scales' block (NF4 per 64-block, int4 per K tile), and
    # the block of int4's zero points too (laid out as the scales).
    mp = x_even.shape[0]
    np_, kp_half = w_bytes.shape
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    with_zero = () if zeros is None else (zeros,)
    return _launch(functools.partial(_packed4_kernel, tile_dot=tile_dot, has_bias=has_bias, has_zero=bool(with_zero)),
                   (x_even, x_odd, w_bytes, scales, *with_zero, bias),
                   [pl.BlockSpec((tm, tk // 2), lambda i, j, k: (i, k)),
                    pl.BlockSpec((tm, tk // 2), lambda i, j, k: (i, k)),
                    pl.BlockSpec((tn, tk // 2), lambda i, j, k: (j, k)),
                    scale_spec, *[scale_spec] * len(with_zero), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, kp=2 * kp_half, out_dtype=out_dtype, acc_dtype=jnp.float32,
                   interpret=interpret, name=name)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def nf4_matmul_tpu(x_even, x_odd, w_bytes, absmax, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                   interpret: bool):
    """Padded operands: x_even/x_odd [Mp, Kp/2], w_bytes [Np, Kp/2] u8, absmax [Np, Kp/64], bias [1, Np]."""
    absmax_spec = pl.BlockSpec((tiling.tn, tiling.tk // 64), lambda i, j, k: (j, k))
    return _packed4_call("_nf4_kernel", nf4_tile_dot, absmax_spec, x_even, x_odd, w_bytes, absmax, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret)


def int4_tile_dot(acc, xe_ref, xo_ref, w_ref, s_ref, z_ref=None, *, nibbles=int4_nibbles):
    """acc + one tile's products: packed int4 bytes w_ref [tn, tile_bytes] with scales s_ref [tn, groups] (and
    zero points z_ref, float32 laid out as the scales, for asymmetric int4).

    Low nibbles meet xe_ref, high nibbles xo_ref. Each code is sign-extended,
    less its group's zero point, times its group's scale in float32 and cast to
    the activation dtype (the reference's dequantize); both products accumulate
    in float32. The tile holds whole groups (one per channel scale: a single group).
    `nibbles` decodes a chunk's bytes into its (low, high) values: int4's sign extension, or FP4's E2M1 table.
    """
    tn, tile_bytes = w_ref.shape
    scales = s_ref[...]  # the tile's [tn, groups] scales: one load, then a column per group
    zeros = None if z_ref is None else z_ref[...]
    group_bytes = tile_bytes // scales.shape[1]
    compute_dtype = xe_ref.dtype
    for start, width in nf4_chunks(tile_bytes):  # the same chunking as NF4: small float planes, whole tile
        cols = slice(start, start + width)
        first, last = start // group_bytes, (start + width - 1) // group_bytes
        scale = group_scale_columns([scales[:, g:g + 1] for g in range(first, last + 1)], (tn, width), group_bytes,
                                    start - first * group_bytes)
        low, high = (c.astype(jnp.float32) for c in nibbles(w_ref[:, cols].astype(jnp.int32)))
        if zeros is not None:
            zero = group_scale_columns([zeros[:, g:g + 1] for g in range(first, last + 1)], (tn, width),
                                       group_bytes, start - first * group_bytes)
            low, high = low - zero, high - zero
        w_low = (low * scale).astype(compute_dtype)
        w_high = (high * scale).astype(compute_dtype)
        acc += jax.lax.dot_general(xe_ref[:, cols], w_low, NT_DIMS,
                                   preferred_element_type=jnp.float32, precision=HIGHEST)
        acc += jax.lax.dot_general(xo_ref[:, cols], w_high, NT_DIMS,
                                   preferred_element_type=jnp.float32, precision=HIGHEST)
    return acc


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int4_weight_matmul_tpu(x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                           interpret: bool, zeros=None):
    """Padded operands: x_even/x_odd [Mp, Kp/2], w_bytes [Np, Kp/2] i8 (int4_weight_operands),
    scales [Kp/tk, Np, groups per K tile] f32, bias [1, Np]; zeros (optional) the zero points, laid out as the
    scales (tiles.int4_group_operand)."""
    scale_spec = pl.BlockSpec((None, tiling.tn, scales.shape[2]), lambda i, j, k: (k, j, 0))
    return _packed4_call("_int4_kernel", int4_tile_dot, scale_spec, x_even, x_odd, w_bytes, scales, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret, zeros=zeros)


fp4_tile_dot = functools.partial(int4_tile_dot, nibbles=fp4_nibbles)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def fp4_weight_matmul_tpu(x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                          interpret: bool):
    """NVFP4A16 / MXFP4A16. Padded operands as int4_weight_matmul_tpu's: w_bytes [Np, Kp/2] i8 E2M1 code pairs
    (int4_weight_operands), scales [Kp/tk, Np, tk/group] f32 (each group's scale over the global scale)."""
    scale_spec = pl.BlockSpec((None, tiling.tn, scales.shape[2]), lambda i, j, k: (k, j, 0))
    return _packed4_call("_fp4_kernel", fp4_tile_dot, scale_spec, x_even, x_odd, w_bytes, scales, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret)
