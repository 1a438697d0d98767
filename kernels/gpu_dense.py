"""GPU (Triton, through Pallas) kernels for the dense quantized matmuls: W8A8 (int8, fp8), W8A16, NF4 and int4
(W4A16).

Grid (M tiles, N tiles); each program walks the whole K axis in a loop inside the
kernel with a register accumulator (int32 for W8A8, float32 otherwise), then
rescales once. Operands arrive padded to whole tiles from dense.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from qconvert.kernels.tiles import Tiling, fp4_nibbles, group_scale_columns, int4_nibbles, nf4_level

NT_DIMS = (((1,), (1,)), ((), ()))
HIGHEST = jax.lax.Precision.HIGHEST


def _compiler_params(tiling: Tiling):
    # Small row tiles are memory-bound decode shapes: fewer warps, deeper pipeline.
    return pltr.CompilerParams(num_warps=4 if tiling.tm <= 32 else 8, num_stages=3)


def _rows(tiling: Tiling, width: int):
    """A [tm, width] block of an operand's rows (all of K: each program loops over it)."""
    return pl.BlockSpec((tiling.tm, width), lambda i, j: (i, 0))


def _cols(tiling: Tiling, width: int):
    """A [tn, width] block of a weight operand's output channels (all of K)."""
    return pl.BlockSpec((tiling.tn, width), lambda i, j: (j, 0))


def _col_vec(tiling: Tiling):
    return pl.BlockSpec((1, tiling.tn), lambda i, j: (0, j))


def _launch(kernel, operands, in_specs, *, tiling: Tiling, mp: int, np_: int, out_dtype, interpret: bool,
            name: str | None = None):
    """The pallas_call of every dense kernel: grid (Mp/tm, Np/tn), a [tm, tn] output block; `in_specs` are the
    operands' blocks, `name` the kernel's name in the lowered module (the kernel function's own by default)."""
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // tiling.tm, np_ // tiling.tn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tiling.tm, tiling.tn), lambda i, j: (i, j)),
        compiler_params=_compiler_params(tiling),
        interpret=interpret,
        name=name,
    )(*operands)


def _w8a8_kernel(x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, *, tk, has_bias):
    # int8 x int8 accumulates exactly in int32. E4M3 x E4M3 operands go straight into Triton's dot: the native
    # fp8 MMA (Hopper, Ada). Its products are exact, but on an H200 its sums came within 2.1e-4 of the largest
    # output, not float32's rounding (docs/BENCHMARKS.md, "GPU run").
    acc_dtype = jnp.int32 if jnp.issubdtype(x_ref.dtype, jnp.integer) else jnp.float32

    def step(k, acc):
        cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
        return acc + jax.lax.dot_general(x_ref[:, cols], w_ref[:, cols], NT_DIMS,
                                         preferred_element_type=acc_dtype)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // tk, step, jnp.zeros(o_ref.shape, acc_dtype))
    y = acc.astype(jnp.float32) * xs_ref[...]
    y = y * ws_ref[...]
    if has_bias:
        y = y + b_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)


def _w8a8_call(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool, interpret: bool):
    (mp, kp), np_ = x_q.shape, w_q.shape[0]
    return _launch(functools.partial(_w8a8_kernel, tk=tiling.tk, has_bias=has_bias), (x_q, w_q, x_scale, w_scale, bias),
                   [_rows(tiling, kp), _cols(tiling, kp), _rows(tiling, 1), _col_vec(tiling), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, out_dtype=out_dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int8_matmul_gpu(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                    interpret: bool = False):
    """Padded operands as for the TPU kernel: x_q [Mp, Kp], w_q [Np, Kp], x_scale [Mp, 1], w_scale/bias [1, Np]."""
    return _w8a8_call(x_q, w_q, x_scale, w_scale, bias, tiling=tiling, out_dtype=out_dtype, has_bias=has_bias,
                      interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def fp8_matmul_gpu(x_q, w_q, x_scale, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                   interpret: bool = False):
    """Padded operands: x_q [Mp, Kp] and w_q [Np, Kp] float8_e4m3fn, x_scale [Mp, 1], w_scale/bias [1, Np] f32."""
    return _w8a8_call(x_q, w_q, x_scale, w_scale, bias, tiling=tiling, out_dtype=out_dtype, has_bias=has_bias,
                      interpret=interpret)


def _w8a16_kernel(x_ref, w_ref, ws_ref, b_ref, o_ref, *, tk, has_bias):
    def step(k, acc):
        cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
        x = x_ref[:, cols]
        return acc + jax.lax.dot_general(x, w_ref[:, cols].astype(x.dtype), NT_DIMS,
                                         preferred_element_type=jnp.float32, precision=HIGHEST)

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // tk, step, jnp.zeros(o_ref.shape, jnp.float32))
    y = acc * ws_ref[...]
    if has_bias:
        y = y + b_ref[...]
    o_ref[...] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int8_weight_matmul_gpu(x, w_q, w_scale, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                           interpret: bool = False):
    """Padded operands: x [Mp, Kp] float, w_q [Np, Kp] i8, w_scale/bias [1, Np] f32."""
    (mp, kp), np_ = x.shape, w_q.shape[0]
    return _launch(functools.partial(_w8a16_kernel, tk=tiling.tk, has_bias=has_bias), (x, w_q, w_scale, bias),
                   [_rows(tiling, kp), _cols(tiling, kp), _col_vec(tiling), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, out_dtype=out_dtype, interpret=interpret)


def _packed4_kernel(xe_ref, xo_ref, w_ref, s_ref, *refs, step_dot, tk, has_bias, has_zero=False):
    """NF4 and int4: two codes a byte, x split into even and odd columns; each K step's tile decoded and
    multiplied by `step_dot` with the step's scale columns (tk/64 absmax blocks, or its int4 groups, and with
    zero points their columns too: their ref follows the scales')."""
    z_ref, (b_ref, o_ref) = (refs[0] if has_zero else None), refs[-2:]
    half = tk // 2
    steps = w_ref.shape[1] // half
    groups = s_ref.shape[1] // steps  # scale columns per K step

    def step(k, acc):
        cols = pl.ds(pl.multiple_of(k * half, half), half)
        scales = int4_step_scales(s_ref, k, groups)
        zero = () if z_ref is None else (int4_step_scales(z_ref, k, groups),)
        return step_dot(acc, xe_ref[:, cols], xo_ref[:, cols], w_ref[:, cols].astype(jnp.int32), scales, *zero)

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(o_ref.shape, jnp.float32))
    if has_bias:
        acc = acc + b_ref[...]
    o_ref[...] = acc.astype(o_ref.dtype)


def _packed4_call(name, step_dot, x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype,
                  has_bias: bool, interpret: bool, zeros=None):
    # NF4 and int4: two codes a byte (Kp/2 byte columns), x split into even and odd columns, the scales' whole row
    # (and int4's zero points', laid out as the scales).
    (mp, kp_half), np_ = x_even.shape, w_bytes.shape[0]
    with_zero = () if zeros is None else (zeros,)
    return _launch(functools.partial(_packed4_kernel, step_dot=step_dot, tk=tiling.tk, has_bias=has_bias,
                                     has_zero=bool(with_zero)),
                   (x_even, x_odd, w_bytes, scales, *with_zero, bias),
                   [_rows(tiling, kp_half), _rows(tiling, kp_half), _cols(tiling, kp_half),
                    *[_cols(tiling, scales.shape[1])] * (1 + len(with_zero)), _col_vec(tiling)],
                   tiling=tiling, mp=mp, np_=np_, out_dtype=out_dtype, interpret=interpret, name=name)


def nf4_step_dot(acc, xe, xo, packed, block_scales):
    """acc + one K step's products: packed int32 [tn, tk/2] bytes, block_scales the tk/64 absmax columns [tn, 1].

    The step's weight tile is decoded once (exact table, times each byte's 64-block
    absmax in float32, cast to the activation dtype) into two planes, high nibbles
    meeting xe [tm, tk/2] and low nibbles xo; both products accumulate in float32.
    Each byte column's block is picked by a select over a lane-index map, so no
    gather, reshape or repeat is needed.
    """
    lane_block = jax.lax.broadcasted_iota(jnp.int32, packed.shape, 1) >> 5  # 32 bytes = one 64-block
    scale = jnp.broadcast_to(block_scales[0], packed.shape)
    for b in range(1, len(block_scales)):
        scale = jnp.where(lane_block == b, block_scales[b], scale)
    w_high = (nf4_level(packed >> 4) * scale).astype(xe.dtype)
    w_low = (nf4_level(packed & 0xF) * scale).astype(xe.dtype)
    acc = acc + jax.lax.dot_general(xe, w_high, NT_DIMS, preferred_element_type=jnp.float32, precision=HIGHEST)
    return acc + jax.lax.dot_general(xo, w_low, NT_DIMS, preferred_element_type=jnp.float32, precision=HIGHEST)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def nf4_matmul_gpu(x_even, x_odd, w_bytes, absmax, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                   interpret: bool = False):
    """Padded operands: x_even/x_odd [Mp, Kp/2], w_bytes [Np, Kp/2] u8, absmax [Np, Kp/64], bias [1, Np]."""
    return _packed4_call("_nf4_kernel", nf4_step_dot, x_even, x_odd, w_bytes, absmax, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret)


def int4_step_dot(acc, xe, xo, packed, group_scales, group_zeros=None, *, nibbles=int4_nibbles):
    """acc + one K step's products: packed int32 [tn, tk/2] bytes (sign-extended), group_scales the step's
    scale columns [tn, 1], one per group (a single one for a per-channel scale), and group_zeros its zero
    point columns alike (asymmetric int4; None: symmetric).

    Each code is sign-extended from its nibble, less its group's zero point,
    times its group's scale in float32 and cast to the activation dtype; low
    nibbles meet xe [tm, tk/2], high nibbles xo, and both products accumulate in float32. `nibbles` decodes
    the bytes into their (low, high) values: int4's sign extension, or FP4's E2M1 table.
    """
    group_bytes = packed.shape[1] // len(group_scales)
    scale = group_scale_columns(group_scales, packed.shape, group_bytes)
    low, high = (c.astype(jnp.float32) for c in nibbles(packed))
    if group_zeros is not None:
        zero = group_scale_columns(group_zeros, packed.shape, group_bytes)
        low, high = low - zero, high - zero
    w_low = (low * scale).astype(xe.dtype)
    w_high = (high * scale).astype(xe.dtype)
    acc = acc + jax.lax.dot_general(xe, w_low, NT_DIMS, preferred_element_type=jnp.float32, precision=HIGHEST)
    return acc + jax.lax.dot_general(xo, w_high, NT_DIMS, preferred_element_type=jnp.float32, precision=HIGHEST)


def int4_step_scales(s_ref, k, groups: int, g=None):
    """The K step k's scale columns [tn, 1] from a [tn, Kp/group] ([G, tn, Kp/group] with expert g) scale ref."""
    if g is None:
        return [s_ref[:, pl.ds(k * groups + b, 1)] for b in range(groups)]
    return [s_ref[g, :, pl.ds(k * groups + b, 1)] for b in range(groups)]


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def int4_weight_matmul_gpu(x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                           interpret: bool = False, zeros=None):
    """Padded operands: x_even/x_odd [Mp, Kp/2], w_bytes [Np, Kp/2] i8 (int4_weight_operands),
    scales [Np, Kp/group] f32, bias [1, Np]; zeros (optional) the zero points [Np, Kp/group] f32."""
    return _packed4_call("_int4_kernel", int4_step_dot, x_even, x_odd, w_bytes, scales, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret, zeros=zeros)


fp4_step_dot = functools.partial(int4_step_dot, nibbles=fp4_nibbles)


@functools.partial(jax.jit, static_argnames=("tiling", "out_dtype", "has_bias", "interpret"))
def fp4_weight_matmul_gpu(x_even, x_odd, w_bytes, scales, bias, *, tiling: Tiling, out_dtype, has_bias: bool,
                          interpret: bool = False):
    """NVFP4A16 / MXFP4A16. Padded operands: x_even/x_odd [Mp, Kp/2], w_bytes [Np, Kp/2] i8 E2M1 code pairs
    (int4_weight_operands), scales [Np, Kp/group] f32 (each group's scale over the global scale), bias [1, Np]."""
    return _packed4_call("_fp4_kernel", fp4_step_dot, x_even, x_odd, w_bytes, scales, bias, tiling=tiling,
                         out_dtype=out_dtype, has_bias=has_bias, interpret=interpret)
