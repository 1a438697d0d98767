"""The correctly rounded float32 quotient, on which FORMATS.md states every rounding rule, and the int8 rounding.

Codes are round(w / scale) and scales absmax / 127, each on the IEEE float32
quotient. XLA turns a division by a constant or a broadcast value into a
multiplication by its rounded reciprocal, which is an ulp off now and then, so
a plain `/` does not give that quotient; `f32_quotient` does, under jit or not.
`int8_round` is the one symmetric int8 rounding rule on it: the weight
quantizer, the activation row quantizer and the searches that model them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import INT8_QMAX


def float64_enabled() -> bool:
    """Whether float64 arrays can be built here (inside `jax.enable_x64(True)`, or with x64 on globally)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.dtype(jnp.float64)


def f32_quotient(numerator, denominator) -> jax.Array:
    """numerator / denominator rounded to float32 exactly as an IEEE float32 division rounds it.

    Both operands hold float32 (or narrower) values; they broadcast as `/` does.

    With float64 on (the weight quantizers trace inside `jax.enable_x64(True)`),
    one float64 multiply by the float64 reciprocal, which fuses into a single pass.
    It is exact: the product is within 2**-52 (relative) of the true quotient t,
    whether or not XLA rewrites the division. A float32 rounding boundary is a
    midpoint m = M * 2**e with M odd and 2**24 <= M < 2**25; with a = A * 2**i,
    d = D * 2**j (A, D < 2**24), a - m * d is a non-zero multiple of 2**(e + j)
    (zero would need the odd part of A, < 2**24, to equal M times the odd part of
    D), so t is at least 1 / (M * D) > 2**-49 (relative) away from every boundary
    and both round to the same float32.

    Without float64, a real float32 division: a divisor of the full shape behind
    an optimization barrier, which XLA cannot turn into a reciprocal.
    """
    numerator = jnp.asarray(numerator)
    if float64_enabled():
        return (numerator.astype(jnp.float64) * (1.0 / jnp.asarray(denominator).astype(jnp.float64))
                ).astype(jnp.float32)
    numerator = numerator.astype(jnp.float32)
    shape = jnp.broadcast_shapes(numerator.shape, jnp.shape(denominator))
    divisor = jnp.broadcast_to(jnp.asarray(denominator, jnp.float32), shape)
    return jnp.broadcast_to(numerator, shape) / jax.lax.optimization_barrier(divisor)


def int8_round(x, scale) -> jax.Array:
    """clip(round_half_even(x / scale), -127, 127) on the exact float32 quotient, as float32 code values.

    `scale` broadcasts against x as `/` does (per row, per tensor or a scalar).
    Callers cast to int8 for codes or multiply by the scale for the dequantized
    value. Usable under jit, vmap and lax.map, with float64 on or off (see
    `f32_quotient`), but not inside a Pallas kernel body: Mosaic has no lowering
    for the optimization barrier. No kernel rounds in its body; the W8A8 kernels
    take rows that kernels.activations quantized before the launch.
    """
    return jnp.clip(jnp.round(f32_quotient(x, scale)), -INT8_QMAX, INT8_QMAX)
