"""Straight-through estimation for quantization-aware training."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray


def ste(fn: Callable) -> Callable:
    """Wrap a quantizer so its forward is quantize-dequantize and its gradient is the identity.

    `fn(w, *args, **kwargs)` returns a QArray (or an already dequantized array)
    for the float master weight `w`; `ste(fn)(w, *args, **kwargs)` returns that
    value dequantized to w's dtype, and passes the incoming gradient straight
    through to `w` (rounding has zero gradient almost everywhere, which would
    stop training). Extra arguments are treated as constants (no gradient).
    """

    @functools.wraps(fn)
    def quantize_dequantize(w, *args, **kwargs):
        @jax.custom_vjp
        def forward(master):
            quantized = fn(master, *args, **kwargs)
            if isinstance(quantized, QArray):
                return quantized.dequantize(master.dtype)
            return jnp.asarray(quantized).astype(master.dtype)

        def forward_with_residuals(master):
            return forward(master), None

        def straight_through(_, g):
            return (g,)

        forward.defvjp(forward_with_residuals, straight_through)
        return forward(jnp.asarray(w))

    return quantize_dequantize
