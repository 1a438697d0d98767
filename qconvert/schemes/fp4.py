"""The FP4 (E2M1) weight math NVFP4 and MXFP4 share: group scales, the rounding onto E2M1, GPTQ's grid.

compressed-tensors' own round-to-nearest is the definition (docs/FORMATS.md, FP4), step by step in the float
types torch takes each step in, so that the codes and scales are its bytes:

- NVFP4 (groups of 16): the tensor's second-level scale g = (1 / absmax) * 2688, each step rounded to the
  weight's dtype (a non-finite g is 1); per group s = e4m3(g * (absmax_group / 6)), the quotient in the
  weight's dtype, the product in float32, clamped to +-448, rounded to E4M3 (a zero scale is 0.125); each
  weight's quotient w / (s / g) in float32.
- MXFP4 (groups of 32): per group s = 2^(floor(log2(p)) - 2), p the group's absmax rounded to a power of two
  (its bits plus half of E2M1's last mantissa step, the mantissa dropped), all in the weight's dtype; the
  quotient w / s in the weight's dtype.
- Both: the quotient clamped to [-6, 6] and rounded to the nearest E2M1 value, a tie to the even mantissa
  (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); a negative quotient keeps its sign
  even where it rounds to zero (code 8, E2M1's -0).

The work is numpy: every step is one IEEE operation whose rounding numpy gives exactly as torch does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qconvert.formats.errors import InvalidWeightError
from qconvert.formats.qarray import FP4_LEVELS, QArray
from qconvert.schemes.grids import E2M1_BOUNDS, E2M1_MAX

E4M3_MAX = 448.0
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E4M3_ZERO_SCALE = 0.125  # compressed-tensors' stand-in for a zero E4M3 group scale


def in_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """float32 x rounded to `dtype` (round to nearest even), kept float32."""
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def e2m1_codes(quotient: np.ndarray) -> np.ndarray:
    """uint8 E2M1 codes of float32 quotients (in units of their scale): clamped to +-6, nearest value, ties to
    even; bit 3 set for a negative quotient, zero included."""
    q = np.asarray(quotient, np.float32)
    a = np.abs(np.clip(q, -E2M1_MAX, E2M1_MAX))
    code = np.zeros(q.shape, np.uint8)
    for bound, up in E2M1_BOUNDS:
        code += (a >= bound) if up else (a > bound)
    return code | (np.signbit(q) & (q != 0)).astype(np.uint8) << 3


def check_finite(w: np.ndarray) -> None:
    if not np.isfinite(np.asarray(w, np.float32)).all():
        raise InvalidWeightError("the weight has NaN or Inf values")


def _groups(w: np.ndarray, group: int) -> np.ndarray:
    rows, cols = w.shape
    if cols % group:
        raise ValueError(f"fp4 group size {group} does not divide the input width {cols}")
    return np.asarray(w, np.float32).reshape(rows, cols // group, group)


def nvfp4_global_scale(absmax: float, dtype) -> np.float32:
    """The second-level scale of a tensor whose largest |w| is `absmax`: 448 * 6 / absmax in the weight's dtype
    (absmax floored at its smallest normal), 1 where that is not finite. torch divides a number by a tensor as
    the tensor's reciprocal times the number, each rounded to the dtype."""
    dtype = np.dtype(dtype)
    tiny = np.float32(ml_dtypes.finfo(dtype).smallest_normal)
    with np.errstate(over="ignore", divide="ignore"):
        reciprocal = in_dtype(np.float32(1.0) / max(np.float32(absmax), tiny), dtype)
        g = in_dtype(reciprocal * np.float32(E4M3_MAX * E2M1_MAX), dtype)
    return np.float32(g) if np.isfinite(g) else np.float32(1.0)


def nvfp4_group_scales(absmax: np.ndarray, global_scale: np.float32, dtype) -> np.ndarray:
    """float32 E4M3 group scales [rows, groups] of group absmax values (float32, exact in `dtype`)."""
    local = in_dtype(np.asarray(absmax, np.float32) / np.float32(E2M1_MAX), dtype)
    with np.errstate(over="ignore"):
        scale = np.clip(np.float32(global_scale) * local, -E4M3_MAX, E4M3_MAX)
    scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return np.where(scale == 0, np.float32(E4M3_ZERO_SCALE), scale)


def nvfp4_effective_scale(scale: np.ndarray, global_scale) -> np.ndarray:
    """float32 scale / global scale: what each E2M1 value is multiplied by."""
    return np.asarray(scale, np.float32) / np.float32(np.asarray(global_scale, np.float32).reshape(()))


def quantize_nvfp4(w, global_scale=None, *, clip=None) -> QArray:
    """The NVFP4 QArray of a [out, in] weight; `global_scale` fixed (the whole tensor's, when `w` is a block of its
    rows) or found from w; `clip` ([out, in / 16] ratios) shrinks each group's absmax first."""
    w = np.asarray(w)
    check_finite(w)
    groups = _groups(w, NVFP4_GROUP)
    if global_scale is None:
        global_scale = nvfp4_global_scale(float(np.abs(groups).max(initial=0.0)), w.dtype)
    absmax = np.abs(groups).max(axis=2)
    if clip is not None:
        absmax = in_dtype(absmax * np.asarray(clip, np.float32).reshape(absmax.shape), w.dtype)
    scale = nvfp4_group_scales(absmax, np.float32(global_scale), w.dtype)
    with np.errstate(over="ignore"):
        quotient = groups / nvfp4_effective_scale(scale, global_scale)[..., None]
    return QArray(qvalue=e2m1_codes(quotient).reshape(w.shape), scale=scale,
                  zero_point=np.full((1, 1), global_scale, np.float32), kind="fp4", block_size=NVFP4_GROUP,
                  shape=w.shape, dtype=w.dtype)


def mx_exponents(absmax: np.ndarray, dtype) -> np.ndarray:
    """float32 group scales 2^k of group absmax values, as compressed-tensors' MX scales round them in `dtype`."""
    dtype = np.dtype(dtype)
    info = ml_dtypes.finfo(dtype)
    bits = {2: np.uint16, 4: np.uint32}[dtype.itemsize]
    mantissa, exponent = info.nmant, info.nexp
    raw = np.asarray(absmax, np.float32).astype(dtype).view(bits).astype(np.int64)
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    power = ((raw + (1 << (mantissa - 2))) & mask).astype(bits).view(dtype).astype(np.float32)
    with np.errstate(divide="ignore"):
        biased = 127 + np.floor(np.log2(power)) - 2  # exact: integers, in any of the three dtypes
    biased = np.round(np.clip(biased, 0, 255))
    scale = in_dtype(np.exp2(biased - 127), dtype)
    return np.where(scale == 0, np.float32(1.0), scale)


def quantize_mxfp4(w, *, clip=None) -> QArray:
    """The MXFP4 QArray of a [out, in] weight (groups of 32, power-of-two scales)."""
    w = np.asarray(w)
    check_finite(w)
    groups = _groups(w, MXFP4_GROUP)
    absmax = np.abs(groups).max(axis=2)
    if clip is not None:
        absmax = in_dtype(absmax * np.asarray(clip, np.float32).reshape(absmax.shape), w.dtype)
    scale = mx_exponents(absmax, w.dtype)
    with np.errstate(over="ignore"):
        quotient = in_dtype(groups / scale[..., None], w.dtype)
    return QArray(qvalue=e2m1_codes(quotient).reshape(w.shape), scale=scale, kind="fp4", block_size=MXFP4_GROUP,
                  shape=w.shape, dtype=w.dtype)


def effective_scale(q: QArray) -> np.ndarray:
    """float32 [out, groups]: what each E2M1 value of `q` is multiplied by."""
    if q.zero_point is None:
        return np.asarray(q.scale, np.float32)
    return nvfp4_effective_scale(q.scale, q.zero_point)


def dequantize_fp4(q: QArray) -> np.ndarray:
    """float32 [out, in] E2M1 value times its effective scale (numpy: the reference of the jnp dequantize)."""
    values = FP4_LEVELS[np.asarray(q.qvalue, np.int64)]
    return values * np.repeat(effective_scale(q), q.block_size, axis=-1)
