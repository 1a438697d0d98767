"""The one router from a QArray to a kernel: a quantized linear layer, dense or by groups of experts.

  int8 weight, float x       int8_weight_matmul (W8A16): x times int8 codes, per-channel scale
  int8 weight, act=...       quantize_activations (per token, or the static input_scale), then
                             int8_matmul: int32 accumulation, x_scale * w_scale rescale
  int8 weight, int8 QArray x int8_matmul on x's codes and scales as they are
  nf4 weight                 nf4_matmul: codes decoded with the NF4 table x block absmax
  int4 weight                int4_weight_matmul (W4A16): codes (less their zero point, W4A16_ASYM) x group
                             (or per-channel) scale
  int4 weight, act=dynamic   W4A8-FP8 (kernels.w4a8): E4M3 per token, int4_weight_matmul on those values,
                             then x token scale (experts: the same ahead of grouped_matmul)
  fp4 weight                 fp4_weight_matmul (NVFP4A16, MXFP4A16): E2M1 codes x group scale (over the
                             global scale where there is one)
  fp8 weight, act=...        quantize_fp8_activations (E4M3 per token, or the static input_scale), then
                             fp8_matmul: E4M3 products, float32 accumulation, x_scale * w_scale rescale
  experts (qgrouped_linear)  grouped_matmul over the experts' stacked QArrays (int8, fp8, NF4, int4 or FP4);
                             with act the rows enter as their quantized values x_q * x_scale in float32
                             (int8 codes for int8 experts, E4M3 codes for fp8 ones)

verify, ops and calibration all reach the kernels through these two functions;
each returns the KernelPlan that ran when asked (return_plan=True).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.kernels.activations import (fake_quantize_fp8_rows, fake_quantize_rows, quantize_activations,
                                          quantize_fp8_activations)
from qconvert.kernels.dense import fp8_matmul, int4_weight_matmul, int8_matmul, int8_weight_matmul, nf4_matmul
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.grouped import grouped_matmul
from qconvert.kernels.fp4 import fp4_weight_matmul
from qconvert.kernels.prepared import PreparedWeight, prepared_matmul
from qconvert.kernels.tiles import decodes_e2m1
from qconvert.kernels.w4a8 import w4a8_fp8_grouped_matmul, w4a8_fp8_matmul

ACT_MODES = (None, "dynamic", "static")


def _check_act(act: str | None, input_scale) -> None:
    if act not in ACT_MODES:
        raise KernelArgumentError(f"qlinear: act must be None, 'dynamic' or 'static', got {act!r}")
    if act is not None and (act == "static") != (input_scale is not None):
        raise KernelArgumentError("qlinear: act='static' needs input_scale, and only it takes one")


def _int8_rows(x: QArray) -> tuple[jax.Array, jax.Array]:
    """(codes [M, K], scales [M]) of int8 activations [..., K] with one scale per row or per tensor."""
    if not x.kind.int8 or x.zero_point is not None:
        raise KernelArgumentError(f"qlinear: quantized activations must be symmetric int8, got {x.kind}")
    if x.scale.shape[-1:] != (1,):
        raise KernelArgumentError(f"qlinear: int8 activations need one scale per row or per tensor, "
                                  f"got scale shape {jnp.shape(x.scale)} for shape {x.shape}")
    k = x.shape[-1]
    m = 1
    for d in x.shape[:-1]:
        m *= d
    x_scale = jnp.broadcast_to(jnp.asarray(x.scale, jnp.float32), x.shape[:-1] + (1,)).reshape(m)
    return jnp.asarray(x.qvalue).reshape(m, k), x_scale


def _channel_scale(q: QArray) -> jax.Array:
    """The [N] per-output-channel scale of an int8 or fp8 weight [N, K]."""
    w_scale = jnp.asarray(q.scale).reshape(-1)
    if w_scale.shape[0] != q.shape[0]:
        raise KernelArgumentError(f"qlinear: {q.kind} weights need one scale per output channel ({q.shape[0]}), "
                                  f"got scale shape {jnp.shape(q.scale)}")
    return w_scale


def qlinear(x, q: QArray, bias=None, *, act: str | None = None, input_scale=None, out_dtype=None,
            backend: str = "auto", return_plan: bool = False):
    """y = x @ W^T (+ bias) for a quantized weight W [out, in] held in a QArray (or a PreparedWeight).

    x [..., in] float, or an int8 QArray (one scale per row or per tensor) that
    goes to int8_matmul as it is. NF4 QArrays go to nf4_matmul and int4 ones to
    int4_weight_matmul (float x only; act=None, or act="dynamic" for W4A8-FP8:
    E4M3 per token first, kernels.w4a8); int8 QArrays go
    to int8_weight_matmul (act=None, W8A16) or, for W8A8, through
    quantize_activations (act="dynamic": per token; act="static": the
    calibrated per-tensor input_scale) into int8_matmul. fp8 QArrays (E4M3,
    per-channel scale) take act="dynamic" (FP8_DYNAMIC: E4M3 per token) or
    act="static", through quantize_fp8_activations into fp8_matmul. out_dtype
    defaults to x's dtype (float32 for int8 activations).
    """
    _check_act(act, input_scale)
    if isinstance(q, PreparedWeight):  # laid out once (prepared.prepare_weight): nothing to pack on this call
        if isinstance(x, QArray):
            raise KernelArgumentError("qlinear: a prepared weight takes float activations (quantized by act)")
        x = jnp.asarray(x)
        y, plan = prepared_matmul(x.reshape(-1, x.shape[-1]), q, bias, act=act, input_scale=input_scale,
                                  out_dtype=out_dtype, backend=backend, return_plan=True)
        y = y.reshape(*x.shape[:-1], q.n)
        return (y, plan) if return_plan else y
    if len(q.shape) != 2:
        raise KernelArgumentError(f"qlinear: the weight must be [out, in], got a QArray of shape {q.shape}")
    if isinstance(x, QArray):
        lead, lhs = x.shape[:-1], _int8_rows(x)  # (codes, scales): already int8
        out_dtype = jnp.float32 if out_dtype is None else out_dtype
    else:
        x = jnp.asarray(x)
        lead, lhs = x.shape[:-1], x.reshape(-1, x.shape[-1])
        out_dtype = x.dtype if out_dtype is None else out_dtype
    route = (_nf4_linear if q.kind.flat_blocks else _fp8_linear if q.kind.float_codes
             else _fp4_linear if _fp4(q)
             else _int4_linear if q.kind.column_groups else _int8_linear)
    y, plan = route(lhs, q, bias, act, input_scale, out_dtype=out_dtype, backend=backend)
    y = y.reshape(*lead, q.shape[0])
    return (y, plan) if return_plan else y


# One route per kind of weight: lhs is float [M, K], or (codes, scales) of int8 activations.

def _nf4_linear(lhs, q: QArray, bias, act, input_scale, *, out_dtype, backend):
    if act is not None or isinstance(lhs, tuple):
        raise KernelArgumentError("qlinear: NF4 weights take float activations; drop act")
    return nf4_matmul(lhs, q.qvalue, q.scale, shape=q.shape, blocksize=q.block_size, bias=bias,
                      out_dtype=out_dtype, backend=backend, return_plan=True)


def _fp8_linear(lhs, q: QArray, bias, act, input_scale, *, out_dtype, backend):
    if act is None or isinstance(lhs, tuple):
        raise KernelArgumentError("qlinear: fp8 weights quantize float activations to E4M3 first: pass "
                                  "act='dynamic' (per token) or act='static' with input_scale")
    _check_symmetric(q, "fp8")
    w_scale = _channel_scale(q)
    x_q, x_scale = quantize_fp8_activations(lhs, input_scale)
    return fp8_matmul(x_q, q.qvalue, x_scale, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                      return_plan=True)


def _int4_linear(lhs, q: QArray, bias, act, input_scale, *, out_dtype, backend):
    if act == "dynamic" and not isinstance(lhs, tuple):  # W4A8-FP8: E4M3 per token ahead of the int4 kernel
        _check_symmetric(q, "int4")
        return w4a8_fp8_matmul(lhs, q.qvalue, q.scale, group_size=q.block_size, bias=bias, out_dtype=out_dtype,
                               backend=backend, return_plan=True)
    if act is not None or isinstance(lhs, tuple):
        raise KernelArgumentError("qlinear: int4 weights take float activations (W4A16) or act='dynamic' "
                                  "(W4A8-FP8: E4M3 per token); not static or int8 activations")
    return int4_weight_matmul(lhs, q.qvalue, q.scale, group_size=q.block_size, bias=bias, out_dtype=out_dtype,
                              backend=backend, return_plan=True, w_zero=q.zero_point)


def _fp4_linear(lhs, q: QArray, bias, act, input_scale, *, out_dtype, backend):
    if act is not None or isinstance(lhs, tuple):
        raise KernelArgumentError("qlinear: FP4 weights take float activations (NVFP4A16, MXFP4A16); drop act")
    return fp4_weight_matmul(lhs, q.qvalue, q.scale, group_size=q.block_size, w_global=q.zero_point, bias=bias,
                             out_dtype=out_dtype, backend=backend, return_plan=True)


def _fp4(q: QArray) -> bool:
    """Whether q holds E2M1 codes in column groups (a level-table kind whose scales run over the last axis)."""
    return decodes_e2m1(q.kind)


def _stack_fp4(qs: Sequence[QArray]) -> QArray:
    """FP4 experts [N, K] as one fp4 QArray (G, N, K): codes [G, N, K], group scales [G, N, K/group] and, for
    NVFP4, each expert's own global scale [G, 1, 1] in the zero_point slot (experts quantized apart keep theirs)."""
    first = qs[0]
    g, (n, k) = len(qs), first.shape
    if any(not _fp4(q) or q.block_size != first.block_size or q.shape != first.shape for q in qs):
        raise KernelArgumentError("stack_experts: FP4 experts must share one shape and group size")
    if any((q.zero_point is None) != (first.zero_point is None) for q in qs):
        raise KernelArgumentError("stack_experts: FP4 experts must all have a global scale (NVFP4) or none (MXFP4)")
    w_global = None if first.zero_point is None else jnp.stack(
        [jnp.asarray(q.zero_point, jnp.float32).reshape(1, 1) for q in qs])
    return QArray(jnp.stack([jnp.asarray(q.qvalue) for q in qs]),
                  jnp.stack([jnp.asarray(q.scale, jnp.float32).reshape(n, -1) for q in qs]), w_global,
                  kind=first.kind, block_size=first.block_size, shape=(g, n, k), dtype=first.dtype)


def _int8_linear(lhs, q: QArray, bias, act, input_scale, *, out_dtype, backend):
    _check_symmetric(q, "int8")
    w_scale = _channel_scale(q)
    if act is None and not isinstance(lhs, tuple):
        return int8_weight_matmul(lhs, q.qvalue, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                                  return_plan=True)
    x_q, x_scale = lhs if isinstance(lhs, tuple) else quantize_activations(lhs, input_scale)
    return int8_matmul(x_q, q.qvalue, x_scale, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                       return_plan=True)


def _check_symmetric(q: QArray, kind: str) -> None:
    if q.zero_point is not None:
        raise KernelArgumentError(f"qlinear: {kind} weights must be symmetric (no zero point)")


def stack_experts(qs: Sequence[QArray]) -> QArray:
    """The experts' [N, K] QArrays as one QArray of logical shape (G, N, K) for grouped_matmul."""
    first = qs[0]
    g, (n, k) = len(qs), first.shape
    if _fp4(first):
        return _stack_fp4(qs)
    if first.kind.channel_scaled:
        if any(q.kind != first.kind or q.shape != first.shape for q in qs):
            raise KernelArgumentError(f"stack_experts: {first.kind} experts must share one kind and shape")
        return QArray(jnp.stack([jnp.asarray(q.qvalue) for q in qs]),
                      jnp.stack([jnp.asarray(q.scale, jnp.float32).reshape(n, 1) for q in qs]),
                      kind=first.kind, shape=(g, n, k), dtype=first.dtype)
    if first.kind.column_groups:
        if any(not q.kind.column_groups or q.block_size != first.block_size or q.shape != first.shape for q in qs):
            raise KernelArgumentError("stack_experts: int4 experts must share one shape and group size")
        if any((q.zero_point is None) != (first.zero_point is None) for q in qs):
            raise KernelArgumentError("stack_experts: int4 experts must all have zero points or none")
        zero_point = None if first.zero_point is None else jnp.stack(
            [jnp.asarray(q.zero_point).reshape(n, -1) for q in qs])
        return QArray(jnp.stack([jnp.asarray(q.qvalue) for q in qs]),
                      jnp.stack([jnp.asarray(q.scale, jnp.float32).reshape(n, -1) for q in qs]), zero_point,
                      kind="int4", block_size=first.block_size, shape=(g, n, k), dtype=first.dtype)
    # NF4 blocks run over the flattened weight; experts concatenate cleanly when
    # each one holds whole blocks (n * k % 64 == 0, which the kernel needs anyway).
    return QArray(jnp.concatenate([jnp.asarray(q.qvalue).reshape(-1) for q in qs]),
                  jnp.concatenate([jnp.asarray(q.scale, jnp.float32).reshape(-1) for q in qs]),
                  kind="nf4", block_size=first.block_size, shape=(g, n, k), dtype=first.dtype)


def int8_rows_by_expert(x, group_sizes, input_scales: Sequence[float | None],
                        fake_quantize=fake_quantize_rows) -> jax.Array:
    """W8A8 activations of rows sorted by expert, as the values x_q * x_scale (float32).

    fake_quantize is the row quantizer: int8 codes (fake_quantize_rows) or E4M3
    codes (fake_quantize_fp8_rows).

    All scales None: per token. Otherwise each expert's rows take that expert's
    static input_scale (rows past the last group take the last expert's).
    """
    if all(s is None for s in input_scales):
        return fake_quantize(x)
    rows = jnp.arange(x.shape[0])
    expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right"), len(input_scales) - 1)
    out = jnp.zeros(x.shape, jnp.float32)
    for e, scale in enumerate(input_scales):
        out = jnp.where((expert == e)[:, None], fake_quantize(x, scale), out)
    return out


def qgrouped_linear(x, qs: Sequence[QArray], group_sizes, *, act: str | None = None,
                    input_scales: Sequence[float | None] = (), backend: str = "auto", return_plan: bool = False):
    """Rows of x [M, in] sorted by expert (group_sizes[e] rows for expert e) times expert e's W^T.

    qs holds each expert's [out, in] QArray (int8, fp8, NF4, int4 or FP4; NF4 and FP4 take
    act=None, int4 act=None or "dynamic" (W4A8-FP8, kernels.w4a8), fp8 needs act). act="dynamic" quantizes every row per
    token, act="static" each expert's rows with its input_scales[e] (to int8
    for int8 experts, to E4M3 for fp8 ones); the quantized rows enter the
    grouped kernel as their float32 values x_q * x_scale, and the experts' codes
    are cast exactly to float32 there.
    """
    if act not in ACT_MODES:
        raise KernelArgumentError(f"qgrouped_linear: act must be None, 'dynamic' or 'static', got {act!r}")
    if (act == "static") != any(s is not None for s in input_scales):
        raise KernelArgumentError("qgrouped_linear: act='static' needs input_scales, and only it takes them")
    if act == "static" and qs and qs[0].kind.column_groups:
        raise KernelArgumentError("qgrouped_linear: int4 experts take float activations (W4A16) or act='dynamic' "
                                  "(W4A8-FP8: E4M3 per token); not static scales")
    if act is None and qs and qs[0].kind.float_codes:
        raise KernelArgumentError("qgrouped_linear: fp8 experts quantize float activations to E4M3 first: pass "
                                  "act='dynamic' (per token) or act='static' with input_scales")
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    if act is not None and qs and _fp4(qs[0]):
        raise KernelArgumentError("qgrouped_linear: FP4 experts take float activations (NVFP4A16, MXFP4A16)")
    if act == "dynamic" and qs[0].kind.column_groups:
        return w4a8_fp8_grouped_matmul(jnp.asarray(x), stack_experts(qs), group_sizes, backend=backend,
                                       return_plan=return_plan)
    if act is not None:
        fake_quantize = fake_quantize_fp8_rows if qs[0].kind.float_codes else fake_quantize_rows
        x = int8_rows_by_expert(jnp.asarray(x), group_sizes, list(input_scales) or [None] * len(qs), fake_quantize)
    return grouped_matmul(x, stack_experts(qs), group_sizes, transpose_rhs=True, backend=backend,
                          return_plan=return_plan)
