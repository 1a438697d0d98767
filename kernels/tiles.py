"""Tile sizes, padding, the NF4 code decode, the int4 nibble packing and the grouped operands shared by the TPU and
GPU kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.qarray import FP4, FP4_LEVELS, FP8, INT4, INT8, NF4, NF4_BLOCK_SIZE, NF4_LEVELS, QKind


# A grouped rhs of plain float weights: quantized by nothing, so no QKind property holds for it.
FLOAT = QKind("float", bits=32)
RHS_KINDS = {kind: kind for kind in (FLOAT, INT8, NF4, INT4, FP8, FP4)}  # name -> the grouped rhs' kind


def rhs_kind_of(kind: str) -> QKind:
    """The grouped rhs kind a name (or kind) stands for: "float", "int8", "nf4", "int4", "fp8" or "fp4"."""
    return RHS_KINDS[kind]


def decodes_e2m1(kind: QKind) -> bool:
    """Whether a kind's codes are E2M1 (FP4): 4-bit codes that index a level table, one scale per group of
    last-axis columns (not NF4's blocks of the flattened tensor)."""
    return kind.packs_nibbles and kind.levels is not None and not kind.flat_blocks


def int4_packed(kind: QKind) -> bool:
    """Whether the kernels take a kind's codes as int4's operands: packed two a byte, low nibble first, with
    one scale per group of input columns (int4 itself, and FP4's E2M1 codes decoded by their table)."""
    return kind.column_groups or decodes_e2m1(kind)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tile sizes of a matmul kernel: rows (tm), reduction (tk) and output columns (tn)."""

    tm: int
    tk: int
    tn: int

    def __str__(self) -> str:
        return f"tm={self.tm} tk={self.tk} tn={self.tn}"


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


def pad2d(a: jax.Array, rows: int, cols: int, value=0) -> jax.Array:
    """Pad a 2-D array at the end of both axes to [rows, cols] (no copy when already that shape)."""
    if a.shape == (rows, cols):
        return a
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])), constant_values=value)


def pad_to(a: jax.Array, shape) -> jax.Array:
    """Pad an array with zeros at the end of every axis to `shape` (no copy when already that shape)."""
    return a if a.shape == tuple(shape) else jnp.pad(a, [(0, t - s) for s, t in zip(a.shape, shape)])


def _table_level(codes: jax.Array, table) -> jax.Array:
    """float32 table[code] of each int32 code 0..15: a binary tree of selects over the 16 constants, one level
    per code bit; no gather (the TPU compiler takes none on vectors) and no approximation."""
    layer = [np.float32(v) for v in table]
    for bit in range(4):
        is_set = ((codes >> bit) & 1) == 1
        layer = [jnp.where(is_set, layer[2 * i + 1], layer[2 * i]) for i in range(len(layer) // 2)]
    return layer[0].astype(jnp.float32)


def nf4_level(codes: jax.Array) -> jax.Array:
    """float32 NF4 level of each int32 code 0..15, exactly NF4_LEVELS[code]."""
    return _table_level(codes, NF4_LEVELS)


def fp4_level(codes: jax.Array) -> jax.Array:
    """float32 E2M1 value of each int32 code 0..15 (bit 3 the sign), exactly FP4_LEVELS[code], -0.0 included."""
    return _table_level(codes, FP4_LEVELS)


def fp4_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 bytes (sign-extended from int8, as pack_int4_pairs packs) -> the (low, high) float32 E2M1 values."""
    return fp4_level(packed & 0xF), fp4_level((packed >> 4) & 0xF)


def split_even_odd_columns(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x[:, 0::2] and x[:, 1::2]: the activations that meet the high and the low nibbles.

    Splitting the (small) activation lets the kernels use each packed byte's two
    codes as two separate weight planes, so no interleave is ever done in-kernel.
    """
    return x[:, 0::2], x[:, 1::2]


def pack_int4_pairs(codes: jax.Array) -> jax.Array:
    """int8 codes [..., K] in [-8, 7], K even -> int8 bytes [..., K/2], two codes per byte.

    Byte j holds column 2j in its low nibble and column 2j + 1 in its high one
    (the earlier column in the lower bits, as compressed-tensors packs), so the
    low nibbles meet x[:, 0::2] and the high ones x[:, 1::2]
    (split_even_odd_columns): the kernels read half the weight bytes and never
    interleave. As a signed byte, the value is high * 16 + (low & 15), exactly.
    """
    codes = jnp.asarray(codes).astype(jnp.int32)
    return ((codes[..., 1::2] << 4) | (codes[..., 0::2] & 0xF)).astype(jnp.int8)


def int4_nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 bytes (sign-extended from int8) -> the (low, high) int32 codes in [-8, 7].

    The high nibble is an arithmetic shift of the signed byte; the low one is
    sign-extended by flipping and removing its sign bit. Shifts and bit ops
    only: no division, which lowers through sign() on the TPU.
    """
    return ((packed & 0xF) ^ 8) - 8, packed >> 4


def group_scale_columns(columns, shape: tuple[int, int], group_bytes: int, offset: int = 0) -> jax.Array:
    """The float32 scale of every byte of a [rows, width] weight chunk, from its groups' scale columns.

    columns[g] ([rows, 1]) is the scale of the g-th group the chunk touches;
    group_bytes bytes (2 * group_bytes codes) share one scale, and the chunk
    starts offset bytes into its first group. A select per group boundary over
    a lane-index map (no gather, reshape or repeat) lowers on both Mosaic and
    Triton.
    """
    scale = jnp.broadcast_to(columns[0], shape)
    if len(columns) == 1:
        return scale
    lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    for g in range(1, len(columns)):
        scale = jnp.where(lane >= g * group_bytes - offset, columns[g], scale)
    return scale


def int4_weight_operands(codes, scale, group_size: int | None, np_: int, kp: int, tk: int, tpu_layout: bool):
    """Pack int4 weights [..., N, K] (scale [..., N, K/group_size] or [..., N, 1]) for the kernels.

    Returns (bytes [..., Np, Kp/2] int8, scales float32). Each K tile of tk codes
    holds whole scale groups; one scale per channel is treated as one group per
    K tile. The scales come [..., Np, Kp/group] for Triton (each program reads
    its rows' whole K range) and [..., Kp/tk, Np, tk/group] for Mosaic, where a
    K tile's scales are one block whose width is the array's whole last axis
    (a narrower block would have to span a multiple of 128 lanes). Padding adds
    zero codes and zero scales, which contribute nothing.
    """
    codes = jnp.asarray(codes)
    lead, (n, k) = codes.shape[:-2], codes.shape[-2:]
    pad = [(0, 0)] * len(lead)
    w_bytes = pack_int4_pairs(jnp.pad(codes, pad + [(0, np_ - n), (0, kp - k)]))
    scale = jnp.asarray(scale, jnp.float32).reshape(*lead, n, -1)
    return w_bytes, int4_group_operand(scale, group_size, np_, kp, tk, tpu_layout)


def int4_group_operand(values, group_size: int | None, np_: int, kp: int, tk: int, tpu_layout: bool) -> jax.Array:
    """Per-group values [..., N, K/group_size] ([..., N, 1] per channel) as float32 in the kernels' scale layout
    (int4_weight_operands'): the scales, and the zero points of asymmetric int4, which ride beside them.
    Padding adds zeros."""
    values = jnp.asarray(values, jnp.float32)
    lead, n = values.shape[:-2], values.shape[-2]
    group = tk if group_size is None else group_size
    if group_size is None:
        values = jnp.broadcast_to(values, (*lead, n, kp // tk))
    pad = [(0, 0)] * len(lead)
    values = jnp.pad(values, pad + [(0, np_ - n), (0, kp // group - values.shape[-1])])
    if tpu_layout:
        values = jnp.moveaxis(values.reshape(*lead, np_, kp // tk, tk // group), -2, -3)
    return values


def grouped_operands(lhs, rhs_kind: QKind, rhs_data, rhs_aux, rhs_zero, *, num_local: int, n: int, k: int, np_: int,
                     kp: int, tk: int, group_size: int | None, transpose_rhs: bool, tpu_layout: bool):
    """(lhs operands, rhs operands) of a grouped matmul's kernel, from lhs [Mp, Kp] (padded) and the checked rhs
    of K = k (grouped.py's _rhs_parts), padded to Np and Kp.

    lhs: itself, or its even and odd columns for NF4, int4 and FP4. rhs: NF4 bytes [G, Np, Kp/2] and absmax
    [G, Np, Kp/64]; int4 (and FP4's E2M1 codes with their float32 group scales over the global scale) as
    int4_weight_operands lays it out, the zero points (rhs_zero, or None) beside the scales; float, int8 or
    fp8 codes [G, Kp, Np] ([G, Np, Kp] with transpose_rhs) and, for int8 and fp8, the per-channel scale
    [G, Np] (Triton) or [G, 1, Np] (Mosaic, tpu_layout).
    """
    if rhs_kind.flat_blocks:
        blocks = k // NF4_BLOCK_SIZE
        return split_even_odd_columns(lhs), (
            pad_to(jnp.asarray(rhs_data).reshape(num_local, n, k // 2), (num_local, np_, kp // 2)),
            pad_to(jnp.asarray(rhs_aux).reshape(num_local, n, blocks), (num_local, np_, kp // NF4_BLOCK_SIZE)))
    if int4_packed(rhs_kind):
        rhs_ops = int4_weight_operands(rhs_data, rhs_aux, group_size, np_, kp, tk, tpu_layout=tpu_layout)
        if rhs_zero is not None:
            rhs_ops += (int4_group_operand(rhs_zero, group_size, np_, kp, tk, tpu_layout=tpu_layout),)
        return split_even_odd_columns(lhs), rhs_ops
    rhs_ops = (pad_to(rhs_data, (num_local, np_, kp) if transpose_rhs else (num_local, kp, np_)),)
    if rhs_kind.channel_scaled:
        scale_shape = (num_local, 1, np_) if tpu_layout else (num_local, np_)
        rhs_ops += (pad_to(rhs_aux.reshape(*scale_shape[:-1], n), scale_shape),)
    return (lhs,), rhs_ops
