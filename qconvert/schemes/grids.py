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


RoundingGrid = IntegerGrid | LevelGrid | FloatGrid
