"""GPTQ (Frantar et al., 2022): round a linear's weight one input column at a time, each column's error fed forward.

The scales are fixed first (round-to-nearest's, or the clip search's), so the
layout is unchanged: GPTQ only chooses other codes on the same grid. Column j
is rounded to the nearest point of its grid; the error, divided by the j-th
diagonal entry of the upper Cholesky factor U of the damped inverse Hessian,
is subtracted from the columns not yet rounded along U's row j. Columns go in
blocks: inside a block the update is immediate, the rest of the matrix gets
the block's errors in one matrix product (the paper's lazy batch update).
With act order the columns go in order of decreasing Hessian diagonal, each
keeping the scale of the group it belongs to in the layout (static groups),
so no permutation is written.

Everything runs in the weight's dtype (float32 in the pipeline; float64 under
`jax.enable_x64` gives the exact reference the tests compare with), as one
compiled program per shape and grid.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qconvert.schemes.grids import RoundingGrid

DEFAULT_DAMP = 0.1         # of the mean Hessian diagonal, added to the diagonal (docs/ACCURACY.md: why not 0.01)
DEFAULT_BLOCK_SIZE = 128   # columns per lazy batch update
DEFAULT_ACT_ORDER = True   # static groups: no permutation written (docs/ACCURACY.md: why it is on)


@dataclasses.dataclass(frozen=True)
class GPTQConfig:
    """The GPTQ choices of a run (qconvert.json's `gptq` record holds them)."""

    damp: float = DEFAULT_DAMP
    block_size: int = DEFAULT_BLOCK_SIZE
    act_order: bool = DEFAULT_ACT_ORDER

    def record(self) -> dict:
        return {"method": "gptq", "damp": self.damp, "block_size": self.block_size, "act_order": self.act_order}


def inverse_cholesky(h: jax.Array) -> jax.Array:
    """U, upper triangular with a positive diagonal, with U^T U = H^-1 (the paper's Cholesky of the inverse).

    One factorization instead of the paper's three: with J the reversal, J H J = L L^T
    gives H = R R^T for the upper triangular R = J L J, so H^-1 = R^-T R^-1 and U = R^-1.
    """
    lower = jnp.linalg.cholesky(h[::-1, ::-1])
    upper = lower[::-1, ::-1]
    return jax.scipy.linalg.solve_triangular(upper, jnp.eye(h.shape[0], dtype=h.dtype), lower=False)


SUB_BLOCK = 16  # columns rounded one by one on their own; the rest of the block takes their errors at once


def _round_block(w1, s1, u1, grid: RoundingGrid, z1=None):
    """One block of columns rounded in order, each error fed into the block's later columns.

    The block goes by sub-blocks of SUB_BLOCK columns: inside one, the columns are rounded one by one on the
    sub-block alone; the block's later columns then take the sub-block's errors in one fused pass, one
    subtraction a column in column order, so every weight sees the same float32 operations in the same order
    as a column-by-column loop over the whole block (the float64 reference's), at a sub-block's memory traffic.
    Returns the block's codes, its dequantized values (grid value * step) and the scaled errors. z1 holds
    the block's zero points (an asymmetric grid's), None for a symmetric grid."""
    width = w1.shape[1]
    steps = jnp.where(s1 == 0, 1, s1)
    parts, errors = [], []
    for a in range(0, width, SUB_BLOCK):
        b = min(a + SUB_BLOCK, width)
        part, error = _round_sub_block(w1[:, a:b], steps[:, a:b], s1[:, a:b], u1[a:b, a:b], grid,
                                       None if z1 is None else z1[:, a:b])
        parts.append(part)
        errors.append(error)
        if b < width:
            rest = w1[:, b:]
            for j in range(b - a):  # one subtraction a column, in column order (no sum of products first)
                rest = rest - error[:, j:j + 1] * u1[a + j:a + j + 1, b:]
            w1 = jnp.concatenate([w1[:, :b], rest], axis=1)
    rounded_from = _signed_zeros(jnp.concatenate(parts, axis=1), jnp.concatenate(errors, axis=1))
    codes, values = grid.round(rounded_from / steps, *(() if z1 is None else (z1,)))
    q = values * s1
    return codes, q, (rounded_from - q) / jnp.diagonal(u1)[None, :]


def _round_sub_block(w1, steps, s1, u1, grid: RoundingGrid, z1):
    """A sub-block's columns rounded in order on the sub-block alone: (the value each column was rounded from,
    each column's scaled error)."""
    later = jnp.arange(w1.shape[1])[None, :] > jnp.arange(w1.shape[1])[:, None]  # [j, k]: k after j
    masked = jnp.where(later, u1, 0)

    def column(j, carry):
        w1, errors = carry
        x = w1[:, j]
        _, value = grid.round(x / steps[:, j], *(() if z1 is None else (z1[:, j],)))
        error = (x - value * s1[:, j]) / u1[j, j]
        return w1 - error[:, None] * masked[j][None, :], errors.at[:, j].set(error)

    return jax.lax.fori_loop(0, w1.shape[1], column, (w1, jnp.zeros_like(w1)))


def _signed_zeros(rounded_from, errors):
    """The values the columns were rounded from, with the sign of zero a loop over the whole block leaves: there
    every later column's error e also subtracts e * 0 from a column already rounded, and -0 - (-0) is +0. So a
    -0 turns +0 where a later column of the block has a negative error (ties of zero only; codes of other
    values are untouched)."""
    negative = jnp.signbit(errors)[:, ::-1]
    later_negative = (jnp.cumsum(negative, axis=1) - negative)[:, ::-1] > 0  # some column after k
    return jnp.where((rounded_from == 0) & later_negative, jnp.zeros_like(rounded_from), rounded_from)


@functools.partial(jax.jit, static_argnames=("act_order",))
def hessian_factor(h: jax.Array, damp, *, act_order: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(U, perm, dead) of an input Hessian h [in, in], in h's dtype: the upper Cholesky factor of the damped
    inverse (in act order when asked), the column order, and the dead columns (H_ii == 0: never seen,
    given H_ii = 1 and weight 0, as the paper does). Linears that read one input share it."""
    n = h.shape[0]
    diag = jnp.diagonal(h)
    dead = diag == 0
    h = h.at[jnp.arange(n), jnp.arange(n)].set(jnp.where(dead, 1, diag))
    # The paper orders by the undamped diagonal, then dampens.
    perm = jnp.argsort(-jnp.diagonal(h), stable=True) if act_order else jnp.arange(n)
    h = h[perm][:, perm]
    h = h + jnp.asarray(damp, h.dtype) * jnp.mean(jnp.diagonal(h)) * jnp.eye(n, dtype=h.dtype)
    return inverse_cholesky(h), perm, dead


@functools.partial(jax.jit, static_argnames=("grid", "block_size"))
def round_columns(w: jax.Array, steps: jax.Array, u: jax.Array, perm: jax.Array, dead: jax.Array, *,
                  grid: RoundingGrid, block_size: int = DEFAULT_BLOCK_SIZE, offsets: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array]:
    """GPTQ's codes [out, in] (in the grid's terms, in w's dtype) of w [out, in] with hessian_factor's (U, perm,
    dead), and the weight they stand for (code value * step); steps [out, in] holds each weight's scale, and
    offsets [out, in] its zero point on an asymmetric grid (None: symmetric), both fixed beforehand."""
    rows, n = w.shape
    dtype = w.dtype
    w = jnp.where(dead[None, :], 0, w)[:, perm]
    steps = steps.astype(dtype)[:, perm]
    padded = -(-n // block_size) * block_size
    # Padding columns: weight 0, unit step, identity in U; their error is 0 and touches nothing.
    w = jnp.pad(w, ((0, 0), (0, padded - n)))
    steps = jnp.pad(steps, ((0, 0), (0, padded - n)), constant_values=1)
    if offsets is not None:
        offsets = jnp.pad(offsets.astype(dtype)[:, perm], ((0, 0), (0, padded - n)))
    u = jnp.pad(u.astype(dtype), ((0, padded - n), (0, padded - n))) + jnp.diag(jnp.arange(padded) >= n).astype(dtype)
    codes = values = jnp.zeros_like(w)
    blocks = padded // block_size
    for first, last in _segments(blocks):
        w, codes, values = _round_segment(w, codes, values, steps, u, offsets, first, last, grid, block_size)
    order = jnp.argsort(perm)
    return codes[:, :n][:, order], values[:, :n][:, order]


LAZY_SEGMENTS = 8  # compiled loops over the blocks, each with its lazy update as wide as its first block needs


def _segments(blocks: int) -> list[tuple[int, int]]:
    """The blocks cut into LAZY_SEGMENTS runs (first, last + 1) of about equal length."""
    cuts = sorted({round(blocks * i / LAZY_SEGMENTS) for i in range(LAZY_SEGMENTS + 1)})
    return list(zip(cuts[:-1], cuts[1:]))


def _round_segment(w, codes, values, steps, u, offsets, first: int, last: int, grid: RoundingGrid,
                   block_size: int):
    """Blocks first..last-1 rounded in order. Each block's errors reach the columns after it in one matrix
    product (the lazy batch update) over the columns from the segment's second block on: those of the block
    and the segment's earlier blocks it also moves are rounded already and never read again, and each
    remaining column's sum over the block's rows of U is the one a product over U's whole width computes."""
    rows, padded = w.shape
    tail = min((first + 1) * block_size, padded)  # the first column a lazy update of this segment must reach

    def block(b, carry):
        w, codes, values = carry
        start = b * block_size
        w1 = jax.lax.dynamic_slice(w, (0, start), (rows, block_size))
        s1 = jax.lax.dynamic_slice(steps, (0, start), (rows, block_size))
        u_rows = jax.lax.dynamic_slice(u, (start, tail), (block_size, padded - tail))
        u1 = jax.lax.dynamic_slice(u, (start, start), (block_size, block_size))
        z1 = None if offsets is None else jax.lax.dynamic_slice(offsets, (0, start), (rows, block_size))
        block_codes, block_values, errors = _round_block(w1, s1, u1, grid, z1)
        if tail < padded:
            w = jax.lax.dynamic_update_slice(w, w[:, tail:] - errors @ u_rows, (0, tail))
        return (w, jax.lax.dynamic_update_slice(codes, block_codes, (0, start)),
                jax.lax.dynamic_update_slice(values, block_values, (0, start)))

    return jax.lax.fori_loop(first, last, block, (w, codes, values))


def gptq_codes(w: jax.Array, h: jax.Array, steps: jax.Array, damp, *, grid: RoundingGrid,
               block_size: int = DEFAULT_BLOCK_SIZE, act_order: bool = False, offsets=None) -> jax.Array:
    """GPTQ's codes [out, in] of a weight w [out, in] on its input Hessian h [in, in] (any positive multiple
    of X^T X), computed in w's dtype; `damp`: the fraction of the mean diagonal added to it; `offsets` [out, in]:
    the zero points of an asymmetric grid."""
    w = jnp.asarray(w)
    u, perm, dead = hessian_factor(jnp.asarray(h, w.dtype), damp, act_order=act_order)
    offsets = None if offsets is None else jnp.asarray(offsets)
    return round_columns(w, jnp.asarray(steps), u, perm, dead, grid=grid, block_size=block_size, offsets=offsets)[0]


@jax.jit
def row_output_errors(w: jax.Array, candidates: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row, d H d^T of each candidate [k, out, in] (d = w - candidate) and w H w^T: summed over a linear's
    rows, the numerator and denominator of output_error, for several linears stacked in one call."""
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    d = w[None] - candidates.astype(jnp.float32)
    return jnp.sum((d @ h) * d, axis=-1), jnp.sum((w @ h) * w, axis=-1)


@jax.jit
def output_error(w: jax.Array, q: jax.Array, h: jax.Array) -> jax.Array:
    """tr((W - Q) H (W - Q)^T) / tr(W H W^T): the relative squared output error on the Hessian's inputs."""
    d = (w - q).astype(jnp.float32)
    w = w.astype(jnp.float32)
    h = h.astype(jnp.float32)
    return jnp.sum((d @ h) * d) / jnp.maximum(jnp.sum((w @ h) * w), jnp.finfo(jnp.float32).tiny)
