"""The dense quantized matmuls (W8A8 int8 and fp8, W8A16, NF4, W4A16): check, plan, pad, launch, slice.

Each entry point takes plain arrays, checks them, asks plan.select_kernel for a
kernel, and runs it (or the reference, when the plan says so). With
return_plan=True it also returns the KernelPlan, so callers can report it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import NF4_BLOCK_SIZE
from qconvert.kernels import gpu_dense, prepared, reference, tpu_dense
from qconvert.kernels.checks import (check_fp8_matmul, check_int4_weight_matmul, check_int8_matmul,
                                     check_int8_weight_matmul, check_nf4_matmul)
from qconvert.kernels.plan import KernelPlan, KernelProblem, Tiling, dtype_name, plan_result, select_kernel
from qconvert.kernels.tiles import int4_group_operand, int4_weight_operands, pad2d, round_up, split_even_odd_columns


def _padded(plan: KernelPlan, m: int, k: int, n: int, k_multiple: int = 1) -> tuple[int, int, int]:
    t = plan.tiling
    return round_up(m, t.tm), round_up(k, max(t.tk, k_multiple)), round_up(n, t.tn)


def _col_vector(v, n: int, np_: int) -> jax.Array:
    v = jnp.zeros((n,), jnp.float32) if v is None else jnp.asarray(v, jnp.float32).reshape(-1)
    return pad2d(v.reshape(1, n), 1, np_)


# The launches below are jitted with the plan static: padding, layout and the
# slice back run at trace time into one compiled call, so an eager call costs
# the argument checks, a cached plan lookup and one dispatch, and a call inside
# a caller's jit adds nothing beyond the kernel.

@functools.partial(jax.jit, static_argnames=("plan", "out_dtype", "codes"))
def _scaled_codes_launch(x_q, w_q, x_scale, w_scale, bias, *, plan: KernelPlan, out_dtype, codes: str):
    """int8 or fp8 (`codes`) codes on both sides, each side's scales applied in the kernel's epilogue."""
    (m, k), n = x_q.shape, w_q.shape[0]
    mp, kp, np_ = _padded(plan, m, k, n)
    x_scale = jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32).reshape(-1), (m,)).reshape(m, 1)
    module, suffix = (gpu_dense, "gpu") if plan.backend == "gpu" else (tpu_dense, "tpu")
    kernel = getattr(module, f"{codes}_matmul_{suffix}")  # int8_matmul_gpu, fp8_matmul_tpu, ...
    y = kernel(pad2d(x_q, mp, kp), pad2d(w_q, np_, kp), pad2d(x_scale, mp, 1), _col_vector(w_scale, n, np_),
               _col_vector(bias, n, np_), tiling=plan.tiling, out_dtype=out_dtype, has_bias=bias is not None,
               interpret=plan.interpret)
    return y[:m, :n]


@functools.partial(jax.jit, static_argnames=("plan", "out_dtype"))
def _int8_weight_matmul_launch(x, w_q, w_scale, bias, *, plan: KernelPlan, out_dtype):
    (m, k), n = x.shape, w_q.shape[0]
    mp, kp, np_ = _padded(plan, m, k, n)
    kernel = gpu_dense.int8_weight_matmul_gpu if plan.backend == "gpu" else tpu_dense.int8_weight_matmul_tpu
    y = kernel(pad2d(x, mp, kp), pad2d(w_q, np_, kp), _col_vector(w_scale, n, np_), _col_vector(bias, n, np_),
               tiling=plan.tiling, out_dtype=out_dtype, has_bias=bias is not None, interpret=plan.interpret)
    return y[:m, :n]


@functools.partial(jax.jit, static_argnames=("plan", "n", "out_dtype"))
def _nf4_matmul_launch(x, w_packed, absmax, bias, *, plan: KernelPlan, n: int, out_dtype):
    m, k = x.shape
    mp, kp, np_ = _padded(plan, m, k, n, k_multiple=NF4_BLOCK_SIZE)
    x_even, x_odd, w_bytes, block_absmax = nf4_operands(x, w_packed, absmax, n, k, mp, kp, np_)
    kernel = gpu_dense.nf4_matmul_gpu if plan.backend == "gpu" else tpu_dense.nf4_matmul_tpu
    y = kernel(x_even, x_odd, w_bytes, block_absmax, _col_vector(bias, n, np_), tiling=plan.tiling,
               out_dtype=out_dtype, has_bias=bias is not None, interpret=plan.interpret)
    return y[:m, :n]


@functools.partial(jax.jit, static_argnames=("plan", "group_size", "out_dtype"))
def _int4_weight_matmul_launch(x, w_codes, w_scale, bias, w_zero=None, *, plan: KernelPlan, group_size: int | None,
                               out_dtype):
    (m, k), n = x.shape, w_codes.shape[0]
    mp, kp, np_ = _padded(plan, m, k, n)
    gpu = plan.backend == "gpu"
    w_bytes, scales = int4_weight_operands(w_codes, w_scale, group_size, np_, kp, plan.tiling.tk, tpu_layout=not gpu)
    zeros = None if w_zero is None else int4_group_operand(jnp.asarray(w_zero).reshape(n, -1), group_size, np_, kp,
                                                           plan.tiling.tk, tpu_layout=not gpu)
    x_even, x_odd = split_even_odd_columns(pad2d(jnp.asarray(x), mp, kp))
    kernel = gpu_dense.int4_weight_matmul_gpu if gpu else tpu_dense.int4_weight_matmul_tpu
    y = kernel(x_even, x_odd, w_bytes, scales, _col_vector(bias, n, np_), tiling=plan.tiling, out_dtype=out_dtype,
               has_bias=bias is not None, interpret=plan.interpret, zeros=zeros)
    return y[:m, :n]


def int8_matmul(x_q, w_q, x_scale, w_scale, *, bias=None, out_dtype=jnp.float32, backend: str = "auto",
                tiling: Tiling | None = None, return_plan: bool = False):
    """W8A8 matmul: y[m, n] = f32(sum_k x_q[m, k] w_q[n, k]) * x_scale[m] * w_scale[n] + bias[n].

    x_q int8 [M, K]; w_q int8 [N, K] (nn.Linear layout); x_scale float [M] (per
    token) or [1] (per tensor); w_scale float [N] (or [N, 1]); bias float [N].
    Accumulates in int32 (exact), then rescales in float32 in the order written
    above and casts once to out_dtype. Bit-identical to int8_matmul_reference.
    """
    shape = check_int8_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype)
    return _scaled_codes_matmul("int8", shape, x_q, w_q, x_scale, w_scale, bias, out_dtype, backend, tiling,
                                return_plan)


def fp8_matmul(x_q, w_q, x_scale, w_scale, *, bias=None, out_dtype=jnp.float32, backend: str = "auto",
               tiling: Tiling | None = None, return_plan: bool = False):
    """FP8 W8A8 matmul: y[m, n] = f32(sum_k x_q[m, k] w_q[n, k]) * x_scale[m] * w_scale[n] + bias[n].

    x_q float8_e4m3fn [M, K] (quantize_fp8_activations: per token); w_q
    float8_e4m3fn [N, K] (nn.Linear layout); x_scale float [M] (per token) or [1]
    (per tensor); w_scale float [N] (or [N, 1]); bias float [N]. Products are exact
    and accumulate in float32; the rescale runs in float32 in the order written
    above, then one cast to out_dtype (compressed-tensors' FP8_DYNAMIC, as vLLM
    runs it). Matches fp8_matmul_reference within float32 summation-order error (on an
    H200's fp8 MMA: within 2.1e-4 of the largest output).
    """
    shape = check_fp8_matmul(x_q, w_q, x_scale, w_scale, bias, out_dtype)
    return _scaled_codes_matmul("fp8", shape, x_q, w_q, x_scale, w_scale, bias, out_dtype, backend, tiling,
                                return_plan)


# The W8A8 matmuls' codes -> the dtype their plans are keyed on.
_CODE_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn"}


def _scaled_codes_matmul(codes: str, shape: tuple[int, int, int], x_q, w_q, x_scale, w_scale, bias, out_dtype,
                         backend: str, tiling: Tiling | None, return_plan: bool):
    """int8_matmul or fp8_matmul (`codes`) on checked arguments of (M, K, N) = shape: the reference, a tuned GPU
    variant on the weight as a prepared operand, or the tiled kernel, as the plan says."""
    m, k, n = shape
    problem = KernelProblem(f"{codes}_matmul", m, k, n, _CODE_DTYPES[codes], dtype_name(out_dtype))
    plan = select_kernel(problem, backend, tiling)
    if plan.is_reference:
        matmul_reference = getattr(reference, f"{codes}_matmul_reference")  # int8_matmul_reference, ...
        return plan_result(matmul_reference(x_q, w_q, x_scale, w_scale, bias=bias, out_dtype=out_dtype), plan,
                           return_plan)
    if plan.variant is not None:  # a tuned GPU variant (gpu_tuning) runs on the weight as a prepared operand
        y = prepared.run_plan(plan, x_q, prepared.channel_weight(codes, w_q, w_scale), x_scale, bias,
                              fmt_name=codes, out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    y = _scaled_codes_launch(x_q, w_q, x_scale, w_scale, bias, plan=plan, out_dtype=jnp.dtype(out_dtype),
                             codes=codes)
    return plan_result(y, plan, return_plan)


def int8_weight_matmul(x, w_q, w_scale, *, bias=None, out_dtype=jnp.float32, backend: str = "auto",
                       tiling: Tiling | None = None, return_plan: bool = False):
    """W8A16 matmul: y = (x @ w_q^T, float32 accumulation) * w_scale[n] + bias[n].

    x float [M, K] (bf16/f16/f32); w_q int8 [N, K] (nn.Linear layout), dequantized
    inside the kernel by an exact cast to x's dtype; w_scale float [N] (or [N, 1]).
    """
    m, k, n = check_int8_weight_matmul(x, w_q, w_scale, bias, out_dtype)
    problem = KernelProblem("int8_weight_matmul", m, k, n, dtype_name(x.dtype), dtype_name(out_dtype))
    plan = select_kernel(problem, backend, tiling)
    if plan.is_reference:
        return plan_result(reference.int8_weight_matmul_reference(x, w_q, w_scale, bias=bias, out_dtype=out_dtype),
                       plan, return_plan)
    if plan.variant is not None:
        y = prepared.run_plan(plan, x, prepared.channel_weight("int8", w_q, w_scale), None, bias,
                              fmt_name="w8a16", out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    y = _int8_weight_matmul_launch(x, w_q, w_scale, bias, plan=plan, out_dtype=jnp.dtype(out_dtype))
    return plan_result(y, plan, return_plan)


def nf4_operands(x, w_packed, absmax, n: int, k: int, mp: int, kp: int, np_: int):
    """Lay NF4 operands out for the kernels without building any full-size float tensor.

    The flat codes of an [N, K] weight with K % 64 == 0 are, unchanged, an
    [N, K/2] byte matrix and an [N, K/64] absmax matrix; x is split into the
    columns that meet high and low nibbles. Padding adds zero bytes, zero absmax
    and zero activations, which contribute nothing.
    """
    w_bytes = pad2d(jnp.asarray(w_packed).reshape(n, k // 2), np_, kp // 2)
    block_absmax = pad2d(jnp.asarray(absmax, jnp.float32).reshape(n, k // NF4_BLOCK_SIZE), np_, kp // NF4_BLOCK_SIZE)
    x_even, x_odd = split_even_odd_columns(pad2d(jnp.asarray(x), mp, kp))
    return x_even, x_odd, w_bytes, block_absmax


def nf4_matmul(x, w_packed, absmax, *, shape, blocksize: int = NF4_BLOCK_SIZE, bias=None,
               out_dtype=jnp.float32, backend: str = "auto", tiling: Tiling | None = None, return_plan: bool = False):
    """NF4 matmul: y = x @ W^T with W [N, K] = shape in the bitsandbytes NF4 layout.

    w_packed uint8 [ceil(N*K/2)] (row-major codes, earlier element in the high
    nibble); absmax float32 [ceil(N*K/blocksize)]. Codes are decoded inside the
    kernel with the exact NF4 table, times the block absmax in float32, cast to
    x's dtype; accumulation is float32. K % 64 != 0 falls back to the reference.
    """
    m, k, n = check_nf4_matmul(x, w_packed, absmax, shape, blocksize, bias, out_dtype)
    problem = KernelProblem("nf4_matmul", m, k, n, dtype_name(x.dtype), dtype_name(out_dtype), blocksize)
    plan = select_kernel(problem, backend, tiling)
    if plan.is_reference:
        y = reference.nf4_matmul_reference(x, w_packed, absmax, shape=(n, k), blocksize=blocksize, bias=bias,
                                           out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    if plan.variant is not None:
        y = prepared.run_plan(plan, x, prepared.nf4_weight(w_packed, absmax, n, k), None, bias, fmt_name="nf4",
                              out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    y = _nf4_matmul_launch(x, w_packed, absmax, bias, plan=plan, n=n, out_dtype=jnp.dtype(out_dtype))
    return plan_result(y, plan, return_plan)


def int4_weight_matmul(x, w_codes, w_scale, *, group_size: int | None, bias=None, out_dtype=jnp.float32,
                       backend: str = "auto", tiling: Tiling | None = None, return_plan: bool = False, w_zero=None):
    """W4A16 matmul: y = x @ W^T + bias[n], W [N, K] the int4 weight q[n, k] * w_scale[n, k // group_size].

    x float [M, K] (bf16/f16/f32); w_codes int8 [N, K], codes in [-8, 7] at the
    logical shape (the kernels keep each code's low nibble); w_scale float
    [N, K/group_size], or [N] / [N, 1] with group_size=None (per channel). K must
    be a multiple of group_size. The launch packs two codes per byte, so the
    kernels read half the weight bytes; they sign-extend each nibble, multiply it
    by its group's scale in float32, cast to x's dtype and accumulate in float32.
    w_zero (optional, asymmetric int4: W4A16_ASYM) holds integer zero points shaped as w_scale; each code then
    dequantizes to (q - zero) * scale.
    """
    m, k, n = check_int4_weight_matmul(x, w_codes, w_scale, group_size, bias, out_dtype, w_zero)
    group_size = None if group_size is None else int(group_size)
    problem = KernelProblem("int4_weight_matmul", m, k, n, dtype_name(x.dtype), dtype_name(out_dtype),
                            group_size=group_size)
    plan = select_kernel(problem, backend, tiling)
    if plan.is_reference:
        y = reference.int4_weight_matmul_reference(x, w_codes, w_scale, group_size=group_size, bias=bias,
                                                   out_dtype=out_dtype, w_zero=w_zero)
        return plan_result(y, plan, return_plan)
    if plan.variant is not None and plan.variant.name != "tiled":
        y = prepared.run_plan(plan, x, prepared.prepare_int4(w_codes, w_scale, group_size, w_zero), None, bias,
                              fmt_name="int4", out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    y = _int4_weight_matmul_launch(x, w_codes, w_scale, bias, w_zero, plan=plan, group_size=group_size,
                                   out_dtype=jnp.dtype(out_dtype))
    return plan_result(y, plan, return_plan)
