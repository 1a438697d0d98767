"""How each weight format's K step reaches a Triton dot in the GPU kernel variants (gpu_decode, gpu_prefill).

A format says what x arrives as (codes for W8A8 int8 and FP8; float for the
weight-only ones, split into even and odd column planes when two codes share a
byte) and how one K step's weight tile is decoded in registers: int8 and E4M3
codes meet x's codes as they are; W8A16 codes are cast exactly to x's dtype;
NF4 codes through the exact table times their 64-block absmax, int4 codes
sign-extended (minus their zero point, when the weight has one) times their
group's scale, FP4's E2M1 codes through their exact table times their group's
scale (over the global scale), all in float32 and then cast to x's dtype, as the contract of
each kernel (kernels/__init__.py) says.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from qconvert.formats.qarray import NF4_BLOCK_SIZE
from qconvert.kernels.tiles import fp4_nibbles, group_scale_columns, int4_nibbles, nf4_level

NT_DIMS = (((1,), (1,)), ((), ()))
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """A weight format as the variant kernels see it.

    packed: two codes a byte (x comes as even/odd column planes, a K step of tk
    reads tk/2 bytes); codes_dot: x is int8 or E4M3 codes that meet the weight's
    codes undecoded (W8A8: x_scale and w_scale in the epilogue); channel_scale:
    the epilogue multiplies by a per-output-channel scale; step_scales: scale
    columns per K step (NF4 absmax blocks, int4 groups) decoded into the tile;
    lookup: codes index NF4's table (high nibble first, fixed 64-blocks);
    column_groups: a scale per group of input columns, or one per channel when
    the group size is None (int4, low nibble first); float_codes: x's codes are
    E4M3 (fp8), else int8; weight_only: the format the same weight serves as
    with float x (act None), where there is one (int8 codes as W8A16);
    e2m1: the column-group codes are E2M1 (FP4), decoded by their table rather
    than sign-extended.
    """

    name: str
    op: str
    packed: bool = False
    codes_dot: bool = False
    channel_scale: bool = False
    step_scales: bool = False
    lookup: bool = False
    column_groups: bool = False
    float_codes: bool = False
    weight_only: str | None = None
    e2m1: bool = False


FORMATS = {f.name: f for f in (
    WeightFormat("int8", "int8_matmul", codes_dot=True, channel_scale=True, weight_only="w8a16"),
    WeightFormat("fp8", "fp8_matmul", codes_dot=True, channel_scale=True, float_codes=True),
    WeightFormat("w8a16", "int8_weight_matmul", channel_scale=True),
    WeightFormat("nf4", "nf4_matmul", packed=True, step_scales=True, lookup=True),
    WeightFormat("int4", "int4_weight_matmul", packed=True, step_scales=True, column_groups=True),
    WeightFormat("fp4", "fp4_weight_matmul", packed=True, step_scales=True, column_groups=True, e2m1=True),
)}


def acc_dtype(fmt: WeightFormat, x_dtype) -> jnp.dtype:
    """int32 for int8 x int8 (exact), float32 for everything else."""
    return jnp.dtype(jnp.int32) if fmt.codes_dot and jnp.issubdtype(x_dtype, jnp.integer) else jnp.dtype(jnp.float32)


def step_columns(fmt: WeightFormat, tk: int, group_size: int | None) -> int:
    """Scale columns one K step of tk codes reads: tk/64 NF4 blocks, tk/group int4 groups (1 per channel)."""
    if fmt.lookup:
        return tk // NF4_BLOCK_SIZE
    return 1 if group_size is None else tk // group_size


def _at(ref, g, cols):
    """ref[:, cols], or expert g's ref[g, :, cols] of a stacked [G, rows, width] ref."""
    return ref[:, cols] if g is None else ref[g, :, cols]


def _scale_columns(ref, k, columns: int, per_channel: bool, g=None):
    if per_channel:
        return [_at(ref, g, pl.ds(0, 1))]
    return [_at(ref, g, pl.ds(k * columns + b, 1)) for b in range(columns)]


def step_pairs(fmt: WeightFormat, x_refs, w_ref, s_ref, z_ref, k, *, tk: int, columns: int, per_channel: bool,
               g=None):
    """The (x tile, weight tile) pairs of K step k, weight tiles decoded to x's dtype (codes for W8A8).

    Each x tile is [rows, width] and each weight tile [tn, width] (width tk, or
    tk/2 for packed formats); their products summed over the pairs are the
    step's contribution to x . W^T. With g, the weight refs are experts stacked
    [G, tn, width] and expert g's tile is read.
    """
    width = tk // 2 if fmt.packed else tk
    cols = pl.ds(pl.multiple_of(k * width, width), width)
    xs = [ref[:, cols] for ref in x_refs]
    w = _at(w_ref, g, cols)
    if fmt.codes_dot:
        return [(xs[0], w)]
    if not fmt.step_scales:  # W8A16: int8 codes cast exactly, the channel scale after the dot
        return [(xs[0], w.astype(xs[0].dtype))]
    packed = w.astype(jnp.int32)
    scales = _scale_columns(s_ref, k, columns, per_channel, g)
    if fmt.lookup:
        # High nibbles are the earlier columns (bitsandbytes); 32 bytes share one absmax.
        scale = group_scale_columns(scales, packed.shape, NF4_BLOCK_SIZE // 2)
        first, second = nf4_level(packed >> 4), nf4_level(packed & 0xF)
    else:
        # Low nibbles are the earlier columns (compressed-tensors); w = (q - z) * s.
        scale = group_scale_columns(scales, packed.shape, width // columns)
        low, high = fp4_nibbles(packed) if fmt.e2m1 else int4_nibbles(packed)
        first, second = low.astype(jnp.float32), high.astype(jnp.float32)
        if z_ref is not None:
            zero = group_scale_columns(_scale_columns(z_ref, k, columns, per_channel, g), packed.shape,
                                       width // columns)
            first, second = first - zero, second - zero
    dtype = xs[0].dtype
    return [(xs[0], (first * scale).astype(dtype)), (xs[1], (second * scale).astype(dtype))]


def dot_rows(x, w, acc_type):
    """x [rows, width] . w [tn, width]^T -> [rows, tn] in acc_type (the MMA)."""
    precision = None if acc_type == jnp.int32 or x.dtype.itemsize == 1 else HIGHEST
    return jax.lax.dot_general(x, w, NT_DIMS, preferred_element_type=acc_type, precision=precision)


def dot_cols(x, w, acc_type):
    """Swap-AB: w [tn, width] . x [rows, width]^T -> [tn, rows], the weight on the MMA's wide side."""
    precision = None if acc_type == jnp.int32 or x.dtype.itemsize == 1 else HIGHEST
    return jax.lax.dot_general(w, x, NT_DIMS, preferred_element_type=acc_type, precision=precision)


def gemv_rows(x, w, acc_type):
    """One row x [1, width] against w [tn, width] on CUDA cores: a broadcast product summed over K -> [tn]."""
    return jnp.sum(x.astype(acc_type) * w.astype(acc_type), axis=1)
