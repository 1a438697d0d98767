"""Test-only quantizers and references for the qconvert.ops and kernel tests, written apart from qconvert."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from qconvert.formats import NF4_LEVELS, QArray


def int8_qarray(x: np.ndarray, shared_axes=(), dtype: str = "float32") -> QArray:
    """Symmetric int8 with one scale per slice along `shared_axes` (kept as size-1 axes)."""
    x = np.asarray(x, np.float32)
    absmax = np.max(np.abs(x), axis=tuple(shared_axes), keepdims=True) if shared_axes else np.abs(x)
    scale = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    if dtype == "bfloat16":
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return QArray(q, scale, kind="int8", shape=x.shape, dtype=dtype)


def int8_values(q: QArray) -> np.ndarray:
    """q's values in float32, computed with numpy."""
    return np.asarray(q.qvalue, np.float32) * np.asarray(q.scale, np.float32)


def nf4_qarray(x: np.ndarray, block_size: int = 64) -> QArray:
    """NF4: absmax per block of the flattened tensor, nearest level, two codes per byte (high nibble first)."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1)
    n = flat.size
    padded = np.concatenate([flat, np.zeros((-n) % block_size, np.float32)])
    absmax = np.max(np.abs(padded.reshape(-1, block_size)), axis=1)
    safe = np.where(absmax > 0, absmax, 1.0)
    normed = padded / np.repeat(safe, block_size)
    codes = np.argmin(np.abs(normed[:, None] - NF4_LEVELS[None, :]), axis=1)[:n].astype(np.uint8)
    if n % 2:
        codes = np.concatenate([codes, np.zeros(1, np.uint8)])
    packed = (codes[0::2] << 4) | codes[1::2]
    return QArray(packed.astype(np.uint8), absmax.astype(np.float32), kind="nf4", block_size=block_size,
                  shape=x.shape, dtype="float32")


def nf4_values(q: QArray) -> np.ndarray:
    """q's values in float32, decoded with numpy."""
    packed = np.asarray(q.qvalue)
    codes = np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)[: q.size]
    absmax = np.repeat(np.asarray(q.scale), q.block_size)[: q.size]
    return (NF4_LEVELS[codes] * absmax).reshape(q.shape)


def int4_qarray(x: np.ndarray, group_size: int | None = None, dtype: str = "float32") -> QArray:
    """Symmetric int4 along the last axis: absmax / 7 per group of group_size columns (per row when None)."""
    x = np.asarray(x, np.float32)
    groups = x.reshape(*x.shape[:-1], -1, x.shape[-1] if group_size is None else group_size)
    absmax = np.max(np.abs(groups), axis=-1)
    scale = np.where(absmax > 0, absmax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(groups / scale[..., None]), -8, 7).astype(np.int8).reshape(x.shape)
    return QArray(q, scale, kind="int4", block_size=group_size, shape=x.shape, dtype=dtype)


def int4_values(q: QArray) -> np.ndarray:
    """q's values in float32, computed with numpy: each code times its group's scale."""
    scale = np.asarray(q.scale, np.float32)
    per_column = np.repeat(scale, q.shape[-1] // scale.shape[-1], axis=-1)
    return np.asarray(q.qvalue, np.float32) * per_column


def group_bounds(sizes) -> np.ndarray:
    """Row offsets of consecutive groups: [0, sizes[0], sizes[0] + sizes[1], ...]."""
    return np.concatenate([[0], np.cumsum(sizes)])


def numpy_grouped(lhs, weights, sizes, offset=0) -> np.ndarray:
    """weights[l] is group (l + offset)'s float64 [K, N]; rows of other groups stay 0."""
    bounds = group_bounds(sizes)
    out = np.zeros((lhs.shape[0], weights[0].shape[1]))
    for local, w in enumerate(weights):
        g = local + offset
        out[bounds[g]:bounds[g + 1]] = lhs[bounds[g]:bounds[g + 1]].astype(np.float64) @ w
    return out


def int8_operands(m, k, n, rng):
    x_q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    w_q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    x_scale = rng.uniform(1e-3, 0.1, m).astype(np.float32)
    w_scale = rng.uniform(1e-3, 0.1, n).astype(np.float32)
    return x_q, w_q, x_scale, w_scale


def numpy_w8a8(x_q, w_q, x_scale, w_scale):
    """The documented rescale in numpy: exact int64 sum, then f32 * x_scale[m], then * w_scale[n]."""
    acc = x_q.astype(np.int64) @ w_q.astype(np.int64).T
    y = acc.astype(np.float32) * x_scale.reshape(-1, 1).astype(np.float32)
    return y * w_scale.reshape(1, -1).astype(np.float32)


def nf4_weight(n, k, rng):
    """Random NF4 codes packed high-nibble-first, absmax per 64-block, and the float64 weight they mean."""
    codes = rng.integers(0, 16, n * k)
    if codes.size % 2:
        codes = np.append(codes, 0)
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    absmax = rng.uniform(0.05, 2.0, -(-n * k // 64)).astype(np.float32)
    weight = NF4_LEVELS[codes[:n * k]].astype(np.float64) * np.repeat(absmax.astype(np.float64), 64)[:n * k]
    return packed, absmax, weight.reshape(n, k)
