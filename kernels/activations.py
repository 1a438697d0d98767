"""Activation quantization for W8A8: per-token dynamic or static per-tensor int8."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qconvert.errors import KernelArgumentError

INT8_MAX = 127


def _true_divide(numerator: jax.Array, divisor) -> jax.Array:
    """numerator / divisor as an IEEE division, element by element.

    XLA rewrites a division by a constant or by a broadcast into a multiplication
    by the rounded reciprocal, which is not always the same number; a full-shape
    divisor behind an optimization barrier keeps the real division.
    """
    divisor = jnp.broadcast_to(jnp.asarray(divisor, jnp.float32), numerator.shape)
    return numerator / jax.lax.optimization_barrier(divisor)


def quantize_activations(x, scale=None) -> tuple[jax.Array, jax.Array]:
    """Quantize float activations x [M, K] to int8 codes and float32 scales.

    scale=None: per token (dynamic), scale[m] = max_k |x[m, k]| / 127, returned
    as [M]; a row of zeros gets scale 1 (its codes are 0 whatever the scale).
    scale given (a scalar or [1]): static per tensor, returned as [1].
    Codes: round-half-to-even(x / scale), clamped to [-127, 127], computed in
    float32 (a division, not a multiplication by the reciprocal).
    """
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise KernelArgumentError(f"quantize_activations expects x of rank 2 [M, K], got shape {x.shape}; "
                                  "reshape leading dimensions into M first")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise KernelArgumentError(f"quantize_activations expects float activations, got {x.dtype}")
    xf = x.astype(jnp.float32)
    if scale is None:
        act_absmax = jnp.max(jnp.abs(xf), axis=1)
        x_scale = jnp.where(act_absmax > 0, _true_divide(act_absmax, INT8_MAX), 1.0).astype(jnp.float32)
        divisor = x_scale[:, None]
    else:
        x_scale = jnp.asarray(scale, jnp.float32).reshape(-1)
        if x_scale.shape != (1,):
            raise KernelArgumentError(f"a static activation scale must be a scalar or shape [1], got {x_scale.shape}; "
                                      "pass scale=None for per-token scales")
        divisor = x_scale[0]
    x_q = jnp.clip(jnp.round(_true_divide(xf, divisor)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return x_q, x_scale
