"""Argument checks run before any kernel launch: dtype, rank, shape and layout, with clear errors."""

from __future__ import annotations

import math

import jax.numpy as jnp

from qconvert.kernels.errors import KernelArgumentError


def _shape(a) -> tuple[int, ...]:
    return tuple(getattr(a, "shape", ()))


def dtype_of(a):
    """The dtype of an array, or of the array a plain Python value would become."""
    # Only a plain Python value needs converting to learn its dtype; converting
    # every array on every call would cost more than the kernel launch itself.
    dtype = getattr(a, "dtype", None)
    return jnp.dtype(jnp.asarray(a).dtype if dtype is None else dtype)


def require_matrix(op: str, name: str, a, dtypes: tuple | None = None, what: str = "") -> tuple[int, int]:
    """a must be rank 2 (and of one of `dtypes`); returns its shape."""
    shape = _shape(a)
    if len(shape) != 2:
        raise KernelArgumentError(f"{op}: {name} must be rank 2 {what}, got shape {shape}")
    if dtypes is not None and dtype_of(a) not in [jnp.dtype(d) for d in dtypes]:
        names = "/".join(str(jnp.dtype(d)) for d in dtypes)
        raise KernelArgumentError(f"{op}: {name} must be {names}, got {dtype_of(a)}")
    return shape


def require_float(op: str, name: str, a) -> None:
    """a must have a floating dtype."""
    if not jnp.issubdtype(dtype_of(a), jnp.floating):
        raise KernelArgumentError(f"{op}: {name} must be a float array, got {dtype_of(a)}")


def require_floatdtype_of(op: str, out_dtype) -> None:
    """out_dtype must be a float dtype."""
    if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise KernelArgumentError(f"{op}: out_dtype must be a float dtype, got {jnp.dtype(out_dtype)}")


def require_vector(op: str, name: str, a, sizes: tuple[int, ...], hint: str) -> None:
    """a must be float and hold one value per entry: shape [s], [s, 1], or () when s == 1."""
    require_float(op, name, a)
    shape = _shape(a)
    squeezed = tuple(d for d in shape if d != 1) or (1,)
    if len(shape) > 2 or math.prod(shape) not in sizes or (len(squeezed) == 1 and squeezed[0] not in sizes):
        raise KernelArgumentError(f"{op}: {name} has shape {shape}; expected {hint}")


def check_int8_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype) -> tuple[int, int, int]:
    """Check W8A8 arguments; returns (M, K, N)."""
    return _check_scaled_codes("int8_matmul", jnp.int8, "[M, K]", x_q, w_q, x_scale, w_scale, bias, out_dtype)


def check_fp8_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype) -> tuple[int, int, int]:
    """Check FP8 W8A8 arguments (float8_e4m3fn codes, per-token and per-channel scales); returns (M, K, N)."""
    return _check_scaled_codes("fp8_matmul", jnp.float8_e4m3fn, "[M, K] (quantize_fp8_activations gives it)",
                               x_q, w_q, x_scale, w_scale, bias, out_dtype)


def _check_scaled_codes(op: str, dtype, x_hint: str, x_q, w_q, x_scale, w_scale, bias,
                        out_dtype) -> tuple[int, int, int]:
    """Codes of `dtype` on both sides, per-token (or per-tensor) and per-channel scales; returns (M, K, N)."""
    m, k = require_matrix(op, "x_q", x_q, (dtype,), x_hint)
    n, k_w = require_matrix(op, "w_q", w_q, (dtype,), "[N, K] (the nn.Linear layout)")
    if k != k_w:
        raise KernelArgumentError(f"{op}: x_q has K={k} but w_q has K={k_w}; w_q must be [N, K] (nn.Linear layout)")
    require_vector(op, "x_scale", x_scale, (m, 1), f"[{m}] (per token) or [1] (per tensor)")
    require_vector(op, "w_scale", w_scale, (n,), f"[{n}] or [{n}, 1] (per output channel)")
    if bias is not None:
        require_vector(op, "bias", bias, (n,), f"[{n}]")
    require_floatdtype_of(op, out_dtype)
    return m, k, n


def check_int8_weight_matmul(x, w_q, w_scale, bias, out_dtype) -> tuple[int, int, int]:
    """Check W8A16 arguments; returns (M, K, N)."""
    op = "int8_weight_matmul"
    m, k = require_matrix(op, "x", x, None, "[M, K]")
    require_float(op, "x", x)
    n, k_w = require_matrix(op, "w_q", w_q, (jnp.int8,), "[N, K] (the nn.Linear layout)")
    if k != k_w:
        raise KernelArgumentError(f"{op}: x has K={k} but w_q has K={k_w}; w_q must be [N, K] (nn.Linear layout)")
    require_vector(op, "w_scale", w_scale, (n,), f"[{n}] or [{n}, 1] (per output channel)")
    if bias is not None:
        require_vector(op, "bias", bias, (n,), f"[{n}]")
    require_floatdtype_of(op, out_dtype)
    return m, k, n


def check_nf4_matmul(x, w_packed, absmax, shape, blocksize, bias, out_dtype) -> tuple[int, int, int]:
    """Check NF4 arguments against the bitsandbytes layout; returns (M, K, N)."""
    op = "nf4_matmul"
    if len(tuple(shape)) != 2:
        raise KernelArgumentError(f"{op}: shape must be the weight's logical (N, K), got {tuple(shape)}")
    n, k = (int(d) for d in shape)
    m, k_x = require_matrix(op, "x", x, None, "[M, K]")
    require_float(op, "x", x)
    if k_x != k:
        raise KernelArgumentError(f"{op}: x has K={k_x} but the weight shape is (N={n}, K={k})")
    if blocksize <= 0:
        raise KernelArgumentError(f"{op}: blocksize must be positive, got {blocksize}")
    if dtype_of(w_packed) != jnp.uint8:
        raise KernelArgumentError(f"{op}: w_packed must be uint8 (two NF4 codes per byte), got {dtype_of(w_packed)}")
    count = n * k
    packed_shape = _shape(w_packed)
    if math.prod(packed_shape) != -(-count // 2) or len([d for d in packed_shape if d != 1]) > 1:
        raise KernelArgumentError(f"{op}: w_packed has shape {packed_shape}; a ({n}, {k}) NF4 weight packs into "
                                  f"[{-(-count // 2)}] (or [{-(-count // 2)}, 1]) bytes")
    if dtype_of(absmax) != jnp.float32:
        raise KernelArgumentError(f"{op}: absmax must be float32 (decode double-quantized absmax first), "
                                  f"got {dtype_of(absmax)}")
    blocks = -(-count // blocksize)
    if math.prod(_shape(absmax)) != blocks:
        raise KernelArgumentError(f"{op}: absmax has shape {_shape(absmax)}; a ({n}, {k}) weight in blocks of "
                                  f"{blocksize} needs [{blocks}]")
    if bias is not None:
        require_vector(op, "bias", bias, (n,), f"[{n}]")
    require_floatdtype_of(op, out_dtype)
    return m, k, n


def check_int4_weight_matmul(x, w_codes, w_scale, group_size, bias, out_dtype, w_zero=None) -> tuple[int, int, int]:
    """Check W4A16 arguments (codes at the logical shape, group or per-channel scales, and zero points shaped as
    the scales where given); returns (M, K, N)."""
    op = "int4_weight_matmul"
    m, k = require_matrix(op, "x", x, None, "[M, K]")
    require_float(op, "x", x)
    n, k_w = require_matrix(op, "w_codes", w_codes, (jnp.int8,), "[N, K] (int4 codes in [-8, 7], nn.Linear layout)")
    if k != k_w:
        raise KernelArgumentError(f"{op}: x has K={k} but w_codes has K={k_w}; w_codes must be [N, K] "
                                  "(nn.Linear layout)")
    require_float(op, "w_scale", w_scale)
    if group_size is None:
        require_vector(op, "w_scale", w_scale, (n,), f"[{n}] or [{n}, 1] (one scale per output channel)")
    else:
        if not isinstance(group_size, int) or group_size <= 0:
            raise KernelArgumentError(f"{op}: group_size must be a positive int or None (per channel), "
                                      f"got {group_size!r}")
        if k % group_size:
            raise KernelArgumentError(f"{op}: K={k} is not a multiple of group_size={group_size}; each scale "
                                      "covers whole groups of input columns")
        if _shape(w_scale) != (n, k // group_size):
            raise KernelArgumentError(f"{op}: w_scale has shape {_shape(w_scale)}; a ({n}, {k}) weight in groups "
                                      f"of {group_size} needs [{n}, {k // group_size}]")
    if w_zero is not None and (_shape(w_zero) != _shape(w_scale)
                               or not jnp.issubdtype(jnp.asarray(w_zero).dtype, jnp.integer)):
        raise KernelArgumentError(f"{op}: w_zero must be integer zero points shaped as w_scale {_shape(w_scale)}, "
                                  f"got {_shape(w_zero)} {jnp.asarray(w_zero).dtype}")
    if bias is not None:
        require_vector(op, "bias", bias, (n,), f"[{n}]")
    require_floatdtype_of(op, out_dtype)
    return m, k, n


def check_fp4_weight_matmul(x, w_codes, w_scale, group_size, w_global, bias, out_dtype) -> tuple[int, int, int]:
    """Check NVFP4A16 / MXFP4A16 arguments (codes at the logical shape, one scale per group, an optional scalar
    global scale); returns (M, K, N)."""
    op = "fp4_weight_matmul"
    m, k = require_matrix(op, "x", x, None, "[M, K]")
    require_float(op, "x", x)
    n, k_w = require_matrix(op, "w_codes", w_codes, (jnp.uint8,), "[N, K] (E2M1 codes 0..15, nn.Linear layout)")
    if k != k_w:
        raise KernelArgumentError(f"{op}: x has K={k} but w_codes has K={k_w}; w_codes must be [N, K] "
                                  "(nn.Linear layout)")
    if not isinstance(group_size, int) or group_size <= 0:
        raise KernelArgumentError(f"{op}: group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        raise KernelArgumentError(f"{op}: K={k} is not a multiple of group_size={group_size}; each scale covers "
                                  "whole groups of input columns")
    require_float(op, "w_scale", w_scale)
    if _shape(w_scale) != (n, k // group_size):
        raise KernelArgumentError(f"{op}: w_scale has shape {_shape(w_scale)}; a ({n}, {k}) weight in groups of "
                                  f"{group_size} needs [{n}, {k // group_size}]")
    if w_global is not None:
        require_float(op, "w_global", w_global)
        if len([d for d in _shape(w_global) if d != 1]):
            raise KernelArgumentError(f"{op}: w_global must be one value (the tensor's global scale), "
                                      f"got shape {_shape(w_global)}")
    if bias is not None:
        require_vector(op, "bias", bias, (n,), f"[{n}]")
    require_floatdtype_of(op, out_dtype)
    return m, k, n


def check_fp4_experts(op: str, w_codes, w_scale, w_global, group_size, shape: tuple[int, int, int]) -> None:
    """Check stacked FP4 experts of logical shape (G, N, K): E2M1 codes uint8 [G, N, K], float scales
    [G, N, K/group_size], and either no global scale (MXFP4) or one float per expert (NVFP4)."""
    g, n, k = shape
    if _shape(w_codes) != (g, n, k) or dtype_of(w_codes) != jnp.uint8:
        raise KernelArgumentError(f"{op}: fp4 rhs codes must be uint8 E2M1 codes [G, N, K] = {(g, n, k)}, got "
                                  f"{_shape(w_codes)} {dtype_of(w_codes)}")
    if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise KernelArgumentError(f"{op}: fp4 rhs K={k} is not a whole number of groups of {group_size!r} columns")
    require_float(op, "fp4 rhs scale", w_scale)
    if _shape(w_scale) != (g, n, k // group_size):
        raise KernelArgumentError(f"{op}: fp4 rhs scale has shape {_shape(w_scale)}; experts {(g, n, k)} in groups "
                                  f"of {group_size} need {(g, n, k // group_size)}")
    if w_global is not None:
        require_float(op, "fp4 rhs global scale", w_global)
        if math.prod(_shape(w_global)) != g or len([d for d in _shape(w_global) if d != 1]) > 1:
            raise KernelArgumentError(f"{op}: an fp4 rhs global scale is one float32 per expert ({g}), "
                                      f"got shape {_shape(w_global)}")
