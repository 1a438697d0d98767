"""The row quantizers of W8A8: int8 and fp8 (E4M3) activations per token (dynamic) or per tensor (static),
and fake-quantized rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import FP8_DTYPE, FP8_E4M3_MAX, INT8_QMAX
from qconvert.formats.quotient import f32_quotient, int8_round
from qconvert.kernels.errors import KernelArgumentError



def _row_scales(op: str, x, scale, qmax) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x in float32, the returned scales, the divisor broadcast against x) of a per-token or static quantizer."""
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise KernelArgumentError(f"{op} expects x of rank 2 [M, K], got shape {x.shape}; "
                                  "reshape leading dimensions into M first")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise KernelArgumentError(f"{op} expects float activations, got {x.dtype}")
    xf = x.astype(jnp.float32)
    if scale is None:
        act_absmax = jnp.max(jnp.abs(xf), axis=1)
        x_scale = jnp.where(act_absmax > 0, f32_quotient(act_absmax, qmax), 1.0).astype(jnp.float32)
        return xf, x_scale, x_scale[:, None]
    x_scale = jnp.asarray(scale, jnp.float32).reshape(-1)
    if x_scale.shape != (1,):
        raise KernelArgumentError(f"a static activation scale must be a scalar or shape [1], got {x_scale.shape}; "
                                  "pass scale=None for per-token scales")
    return xf, x_scale, x_scale[0]


def quantize_activations(x, scale=None) -> tuple[jax.Array, jax.Array]:
    """Quantize float activations x [M, K] to int8 codes and float32 scales.

    scale=None: per token (dynamic), scale[m] = max_k |x[m, k]| / 127, returned
    as [M]; a row of zeros gets scale 1 (its codes are 0 whatever the scale).
    scale given (a scalar or [1]): static per tensor, returned as [1].
    Codes: round-half-to-even(x / scale), clamped to [-127, 127], computed in
    float32 (a division, not a multiplication by the reciprocal).
    """
    xf, x_scale, divisor = _row_scales("quantize_activations", x, scale, INT8_QMAX)
    x_q = int8_round(xf, divisor).astype(jnp.int8)
    return x_q, x_scale


def fake_quantize_rows(x, scale=None) -> jax.Array:
    """x [M, K] through quantize_activations and back: the int8 codes times their scale, in float32.

    The value a W8A8 matmul really multiplies: per row with scale=None (per token
    of an activation, or per output channel when x is a weight), per tensor with
    a static scale.
    """
    x_q, x_scale = quantize_activations(x, scale)
    return x_q.astype(jnp.float32) * (x_scale[:, None] if scale is None else x_scale[0])


def quantize_fp8_activations(x, scale=None) -> tuple[jax.Array, jax.Array]:
    """Quantize float activations x [M, K] to float8_e4m3fn codes and float32 scales (FP8_DYNAMIC's inputs).

    scale=None: per token (dynamic), scale[m] = max_k |x[m, k]| / 448, returned
    as [M]; a row of zeros gets scale 1 (its codes are 0 whatever the scale).
    scale given (a scalar or [1]): static per tensor, returned as [1].
    Codes: x / scale in float32 (a division, not a multiplication by the
    reciprocal), clamped to [-448, 448] (E4M3 has no infinity: an unclamped
    overflow would become NaN), then cast to E4M3 with round-to-nearest-even.
    """
    xf, x_scale, divisor = _row_scales("quantize_fp8_activations", x, scale, FP8_E4M3_MAX)
    x_q = jnp.clip(f32_quotient(xf, divisor), -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(FP8_DTYPE)
    return x_q, x_scale


def fake_quantize_fp8_rows(x, scale=None) -> jax.Array:
    """x [M, K] through quantize_fp8_activations and back: the E4M3 codes times their scale, in float32."""
    x_q, x_scale = quantize_fp8_activations(x, scale)
    return x_q.astype(jnp.float32) * (x_scale[:, None] if scale is None else x_scale[0])


def e4m3_rows(x) -> tuple[jax.Array, jax.Array]:
    """(E4M3 values of x [M, K] per token, in float32; their scales [M, 1] float32)."""
    x_q, x_scale = quantize_fp8_activations(x)
    return x_q.astype(jnp.float32), x_scale.reshape(-1, 1)


def rescale_rows(y: jax.Array, x_scale: jax.Array, bias, out_dtype) -> jax.Array:
    """W4A8-FP8's epilogue: y [M, N] (the dot of E4M3 values) times each token's scale [M, 1], plus the bias."""
    y = y * x_scale
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32).reshape(1, -1)
    return y.astype(out_dtype)
