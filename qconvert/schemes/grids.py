"""The grids GPTQ rounds a column onto, one per kind of code a scheme writes (each scheme's `gptq_grid`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class IntegerGrid:
    """Integer codes in [qmin, qmax]: code = clip(round(x)), value = code (int8, int4); with zero points z
    (asymmetric int4), code = clip(round(x) + z) and value = code - z."""

    qmin: int
    qmax: int

    def round(self, x: jax.Array, offset: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(codes, values) of x given in units of its scale, both in x's dtype; `offset`: x's zero points."""
        if offset is None:
            code = jnp.clip(jnp.round(x), self.qmin, self.qmax)
            return code, code
        code = jnp.clip(jnp.round(x) + offset, self.qmin, self.qmax)
        return code, code - offset


@dataclasses.dataclass(frozen=True)
class LevelGrid:
    """Codes that index a sorted table of levels (NF4): the code of x is how many midpoints x lies above."""

    levels: tuple[float, ...]

    def round(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        levels = np.asarray(self.levels, np.float32)
        midpoints = jnp.asarray((levels[1:] + levels[:-1]) / np.float32(2), x.dtype)
        code = jnp.sum(x[..., None] > midpoints, axis=-1)
        return code.astype(x.dtype), jnp.asarray(levels, x.dtype)[code]


@dataclasses.dataclass(frozen=True)
class FloatGrid:
    """Float8 E4M3 codes saturated at +-limit: value = float8(x), round to nearest even."""

    limit: float

    def round(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        value = jnp.clip(x, -self.limit, self.limit).astype(jnp.float8_e4m3fn).astype(x.dtype)
        return value, value


# E2M1's magnitudes' rounding boundaries, each with whether a value on it rounds up (a tie goes to the even
# mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E2M1_MAX = 6.0


@dataclasses.dataclass(frozen=True)
class E2M1Grid:
    """FP4 E2M1 codes (NVFP4, MXFP4): x in units of its group's scale, clamped to +-6, to the nearest E2M1 value
    (ties to even); code = its 4-bit code (bit 3 the sign, kept for a negative x that rounds to zero), value
    = the E2M1 value."""

    def round(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        from qconvert.formats.qarray import FP4_LEVELS

        a = jnp.abs(jnp.clip(x, -E2M1_MAX, E2M1_MAX))
        code = jnp.zeros(x.shape, jnp.int32)
        for bound, up in E2M1_BOUNDS:
            code = code + ((a >= bound) if up else (a > bound)).astype(jnp.int32)
        code = code + 8 * (x < 0).astype(jnp.int32)
        return code.astype(x.dtype), jnp.asarray(FP4_LEVELS, x.dtype)[code]


RoundingGrid = IntegerGrid | LevelGrid | FloatGrid | E2M1Grid
