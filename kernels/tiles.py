"""Tile sizes, padding and the NF4 code decode shared by the TPU and GPU kernels."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.qarray import NF4_LEVELS


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


def nf4_level(codes: jax.Array) -> jax.Array:
    """float32 NF4 level of each int32 code 0..15, exactly NF4_LEVELS[code].

    A binary tree of selects over the 16 table constants, one level per code bit:
    no gather (the TPU compiler takes none on vectors) and no approximation.
    """
    layer = [np.float32(v) for v in NF4_LEVELS]
    for bit in range(4):
        is_set = ((codes >> bit) & 1) == 1
        layer = [jnp.where(is_set, layer[2 * i + 1], layer[2 * i]) for i in range(len(layer) // 2)]
    return layer[0].astype(jnp.float32)


def split_even_odd_columns(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x[:, 0::2] and x[:, 1::2]: the activations that meet the high and the low nibbles.

    Splitting the (small) activation lets the kernels use each packed byte's two
    codes as two separate weight planes, so no interleave is ever done in-kernel.
    """
    return x[:, 0::2], x[:, 1::2]
