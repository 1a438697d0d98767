"""Weight quantization math: per-output-channel symmetric int8 and NF4 blocks of 64, in jitted JAX."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.errors import InvalidWeightError
from qconvert.formats.packing import pack_nf4_codes
from qconvert.formats.qarray import NF4_LEVELS, QArray

INT8_QMAX = 127
NF4_BLOCK_SIZE = 64

# Decision thresholds between neighbouring NF4 levels: a value goes to the
# number of thresholds it lies strictly above, so a tie lands on the lower code.
NF4_THRESHOLDS = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / np.float32(2)).astype(np.float32)


def exact_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator, correctly rounded as IEEE (and numpy) divide.

    XLA rewrites a division by a broadcast value into a multiplication by its
    reciprocal, which is off by an ulp now and then and so flips a rounding at a
    .5 boundary; materializing the broadcast behind a barrier keeps a true division.
    """
    return numerator / jax.lax.optimization_barrier(jnp.broadcast_to(denominator, numerator.shape))


def _scale_floor(scale_dtype) -> float:
    # Clamp all-zero rows away from a zero scale; the floor must survive the cast
    # to fp16, whose smallest subnormal is ~6e-8.
    return max(1e-8, float(jnp.finfo(scale_dtype).smallest_subnormal))


@functools.partial(jax.jit, static_argnames=("scale_dtype",))
def int8_codes_and_scales(w: jax.Array, scale_dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per output row: scale = absmax / 127 (rounded to scale_dtype), q = round_half_even(w / scale).

    The third result says whether every value of w is finite.
    """
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=1, keepdims=True)
    scale = jnp.maximum(exact_divide(absmax, jnp.float32(INT8_QMAX)), _scale_floor(scale_dtype))
    scale = scale.astype(scale_dtype)
    # Divide by the scale exactly as loaders will multiply it back: the rounded one.
    q = jnp.clip(jnp.round(exact_divide(w32, scale.astype(jnp.float32))), -INT8_QMAX, INT8_QMAX)
    return q.astype(jnp.int8), scale, jnp.all(jnp.isfinite(w32))


def _check_finite(finite: jax.Array) -> None:
    # An explicit flag: XLA's vectorized max does not reliably carry a NaN into the scales.
    if not bool(finite):
        raise InvalidWeightError("the weight has NaN or Inf values")


def quantize_int8(w, *, scale_dtype=None) -> QArray:
    """Symmetric per-output-channel int8 of a [out, in] weight; scale_dtype defaults to w's dtype.

    Raises InvalidWeightError for NaN/Inf values.
    """
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"int8 quantization takes a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    scale_dtype = jnp.dtype(scale_dtype if scale_dtype is not None else w.dtype)
    q, scale, finite = int8_codes_and_scales(w, scale_dtype)
    _check_finite(finite)
    return QArray(qvalue=q, scale=scale, kind="int8", shape=w.shape, dtype=w.dtype)


@functools.partial(jax.jit, static_argnames=("block_size",))
def nf4_codes_and_absmax(w: jax.Array, block_size: int = NF4_BLOCK_SIZE) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row-major flattened NF4 codes (uint8, one per element), float32 absmax per block, and all-finite."""
    flat = w.astype(jnp.float32).reshape(-1)
    n = flat.shape[0]
    nblocks = -(-n // block_size)
    blocks = jnp.pad(flat, (0, nblocks * block_size - n)).reshape(nblocks, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    # An all-zero block normalizes to 0 (code 7, the level 0.0) instead of NaN.
    normalized = exact_divide(blocks, jnp.where(absmax == 0, 1.0, absmax)[:, None])
    thresholds = jnp.asarray(NF4_THRESHOLDS)
    codes = jnp.sum(normalized[..., None] > thresholds, axis=-1, dtype=jnp.int32)
    return codes.reshape(-1)[:n].astype(jnp.uint8), absmax, jnp.all(jnp.isfinite(flat))


def quantize_nf4(w, block_size: int = NF4_BLOCK_SIZE) -> QArray:
    """NF4 of a weight: absmax per block of `block_size` over the row-major flattened values.

    Raises InvalidWeightError for NaN/Inf values.
    """
    w = jnp.asarray(w)
    if w.size == 0:
        raise ValueError(f"NF4 quantization takes a non-empty weight, got shape {tuple(w.shape)}")
    codes, absmax, finite = nf4_codes_and_absmax(w, block_size)
    _check_finite(finite)
    return QArray(qvalue=pack_nf4_codes(np.asarray(codes)), scale=absmax, kind="nf4",
                  block_size=block_size, shape=w.shape, dtype=w.dtype)
