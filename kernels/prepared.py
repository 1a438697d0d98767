"""Weight operands prepared once per weight (packed, scales placed) and the matmul that runs on them.

prepare_weight lays a quantized weight out as the kernels read it: int8 and
E4M3 codes [N, K] with their per-channel scale as a [1, N] row; NF4 codes as
the [N, K/2] byte matrix they already are with absmax [N, K/64]; int4 codes
packed two a byte ([N, K/2], column 2j in the low nibble) with scales
[N, K/group] ([N, 1] per channel) and, for an asymmetric weight, zero points
of the scale's shape (w = (q - z) * s). Loading and verify call it once per
weight; prepared_matmul then only pads (nothing, at tile-aligned shapes) and
launches, where int4_weight_matmul packs the codes on every call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import NF4_BLOCK_SIZE, NF4_LEVELS, QArray
from qconvert.kernels import gpu_decode, gpu_dense, gpu_prefill, reference, tpu_dense
from qconvert.kernels.activations import e4m3_rows, quantize_activations, quantize_fp8_activations, rescale_rows
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.gpu_formats import FORMATS
from qconvert.kernels.plan import KernelPlan, KernelProblem, dtype_name, plan_result, select_kernel
from qconvert.kernels.tiles import Tiling, int4_nibbles, pad2d, round_up, split_even_odd_columns


@dataclasses.dataclass(frozen=True)
class PreparedWeight:
    """A weight [n, k] laid out for the kernels: kind "int8", "fp8", "nf4" or "int4" (see the module doc)."""

    kind: str
    n: int
    k: int
    group_size: int | None
    w: jax.Array
    scale: jax.Array
    zero: jax.Array | None = None

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The weight [n, k] as numbers in `dtype` (weight_values), as QArray.dequantize gives a QArray's."""
        return weight_values(self, dtype)


jax.tree_util.register_dataclass(PreparedWeight, data_fields=["w", "scale", "zero"],
                                 meta_fields=["kind", "n", "k", "group_size"])


def prepare_weight(q: QArray) -> PreparedWeight:
    """The prepared operand of a quantized [N, K] weight (int8, fp8, NF4 with K % 64 == 0, or int4)."""
    if len(q.shape) != 2:
        raise KernelArgumentError(f"prepare_weight: the weight must be [out, in], got shape {q.shape}")
    n, k = q.shape
    if q.kind.flat_blocks:
        if q.block_size != NF4_BLOCK_SIZE or k % NF4_BLOCK_SIZE:
            raise KernelArgumentError(f"prepare_weight: NF4 weights need blocks of {NF4_BLOCK_SIZE} and K a multiple "
                                      f"of it, got blocks of {q.block_size} and K={k}")
        return PreparedWeight("nf4", n, k, NF4_BLOCK_SIZE, jnp.asarray(q.qvalue).reshape(n, k // 2),
                              jnp.asarray(q.scale, jnp.float32).reshape(n, k // NF4_BLOCK_SIZE))
    if q.kind.column_groups:
        return prepare_int4(q.qvalue, q.scale, q.block_size, q.zero_point)
    if q.zero_point is not None:
        raise KernelArgumentError(f"prepare_weight: {q.kind} weights must be symmetric (no zero point)")
    kind = "fp8" if q.kind.float_codes else "int8"
    scale = jnp.asarray(q.scale, jnp.float32).reshape(-1)
    if scale.shape[0] != n:
        raise KernelArgumentError(f"prepare_weight: {kind} weights need one scale per output channel ({n}), "
                                  f"got scale shape {jnp.shape(q.scale)}")
    return PreparedWeight(kind, n, k, None, jnp.asarray(q.qvalue), scale.reshape(1, n))


def prepare_int4(codes, scale, group_size: int | None, zero=None) -> PreparedWeight:
    """int4 codes [N, K] (their low nibbles) with scale [N, K/group] ([N] or [N, 1] per channel) and optional
    zero points of the scale's shape, packed two a byte once."""
    from qconvert.kernels.tiles import pack_int4_pairs

    codes = jnp.asarray(codes)
    n, k = codes.shape
    if k % 2 or (group_size is not None and k % group_size):
        raise KernelArgumentError(f"prepare_int4: K={k} must be even and a multiple of the group size {group_size}")
    columns = 1 if group_size is None else k // group_size
    scale = jnp.asarray(scale, jnp.float32).reshape(n, columns)
    zero = None if zero is None else jnp.asarray(zero, jnp.float32).reshape(n, columns)
    return PreparedWeight("int4", n, k, group_size, pack_int4_pairs(codes), scale, zero)


def dequantize(weight: PreparedWeight, dtype) -> jax.Array:
    """The weight [N, K] in `dtype` as the kernels decode it: int8 / E4M3 codes cast (their scale applies after
    the dot), NF4 level * absmax and int4 (q - z) * scale in float32, then cast."""
    n, k, fmt = weight.n, weight.k, FORMATS[weight.kind]
    if fmt.codes_dot:
        return weight.w.astype(dtype)
    packed = weight.w.astype(jnp.int32)
    if fmt.lookup:
        codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(n, k)
        values = jnp.asarray(NF4_LEVELS, jnp.float32)[codes]
        scale, zero = jnp.repeat(weight.scale, NF4_BLOCK_SIZE, axis=1), None
    else:
        values = jnp.stack(int4_nibbles(packed), axis=-1).reshape(n, k).astype(jnp.float32)
        repeat = k if weight.group_size is None else weight.group_size
        scale = jnp.repeat(weight.scale, repeat, axis=1)
        zero = None if weight.zero is None else jnp.repeat(weight.zero, repeat, axis=1)
    if zero is not None:
        values = values - zero
    return (values * scale).astype(dtype)


def weight_values(weight: PreparedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight [N, K] as numbers in `dtype`: dequantize's values with an int8 / E4M3 channel scale applied
    too (the float view a reference matmul takes)."""
    values = dequantize(weight, jnp.float32)
    if FORMATS[weight.kind].channel_scale:
        values = values * weight.scale.reshape(weight.n, 1)
    return values.astype(dtype)


def _format(weight: PreparedWeight, act: str | None) -> str:
    fmt = FORMATS[weight.kind]
    if act is None and fmt.weight_only:
        return fmt.weight_only
    if fmt.codes_dot and act is None:
        raise KernelArgumentError(f"prepared_matmul: {weight.kind} weights quantize float activations first: pass "
                                  "act='dynamic' (per token) or act='static' with input_scale")
    if not fmt.codes_dot and act is not None:
        raise KernelArgumentError(f"prepared_matmul: {weight.kind} weights take float activations; drop act")
    return weight.kind


def prepared_matmul(x, weight: PreparedWeight, bias=None, *, act: str | None = None, input_scale=None,
                    out_dtype=None, backend: str = "auto", tiling: Tiling | None = None, variant=None,
                    return_plan: bool = False):
    """y [M, N] = x [M, K] . W^T (+ bias) for a prepared weight, through the kernel its plan names.

    act (None, "dynamic" or "static" with input_scale) quantizes x to int8 or E4M3 first for int8 (W8A8) and
    fp8 weights, as qlinear does; act="dynamic" on an int4 weight is W4A8-FP8 (E4M3 per token, kernels.w4a8). tiling and variant (gpu_tuning.Variant) override the plan's choice on GPU.
    """
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != weight.k:
        raise KernelArgumentError(f"prepared_matmul: x must be [M, {weight.k}], got shape {x.shape}")
    if act not in (None, "dynamic", "static") or (act == "static") != (input_scale is not None):
        raise KernelArgumentError(f"prepared_matmul: act must be None, 'dynamic' or 'static' (and only 'static' "
                                  f"takes input_scale), got act={act!r}")
    if bias is not None and jnp.size(bias) != weight.n:
        raise KernelArgumentError(f"prepared_matmul: bias must be [{weight.n}], got shape {jnp.shape(bias)}")
    if act == "dynamic" and FORMATS[weight.kind].column_groups:
        # W4A8-FP8: E4M3 per token ahead of the int4 kernel, the token scale after it (kernels.w4a8).
        x_e4m3, x_scale = e4m3_rows(x)
        y, plan = prepared_matmul(x_e4m3, weight, out_dtype=jnp.float32, backend=backend, tiling=tiling,
                                  variant=variant, return_plan=True)
        return plan_result(rescale_rows(y, x_scale, bias, jnp.dtype(x.dtype if out_dtype is None else out_dtype)),
                           plan, return_plan)
    fmt_name = _format(weight, act)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    x_scale = None
    fmt = FORMATS[fmt_name]
    if fmt.codes_dot:
        quantize = quantize_fp8_activations if fmt.float_codes else quantize_activations
        x, x_scale = quantize(x, input_scale)
    group = _column_group(weight)
    problem = KernelProblem(fmt.op, x.shape[0], weight.k, weight.n, dtype_name(x.dtype), dtype_name(out_dtype),
                            group_size=group)
    plan = select_kernel(problem, backend, tiling, variant=variant)
    y = run_plan(plan, x, weight, x_scale, bias, fmt_name=fmt_name, out_dtype=out_dtype)
    return plan_result(y, plan, return_plan)


def channel_weight(kind: str, w_q, w_scale) -> PreparedWeight:
    """An int8 or fp8 weight [N, K] and its per-channel scale [N] (or [N, 1]) as a prepared operand."""
    n, k = jnp.shape(w_q)
    return PreparedWeight(kind, n, k, None, jnp.asarray(w_q), jnp.asarray(w_scale, jnp.float32).reshape(1, n))


def nf4_weight(w_packed, absmax, n: int, k: int) -> PreparedWeight:
    """bitsandbytes NF4 codes of an [N, K] weight (K % 64 == 0) and their absmax as a prepared operand."""
    return PreparedWeight("nf4", n, k, NF4_BLOCK_SIZE, jnp.asarray(w_packed).reshape(n, k // 2),
                          jnp.asarray(absmax, jnp.float32).reshape(n, k // NF4_BLOCK_SIZE))


def run_plan(plan: KernelPlan, x, weight: PreparedWeight, x_scale, bias, *, fmt_name: str, out_dtype) -> jax.Array:
    """Run a plan (any backend, any variant) on x (int8 / E4M3 codes for W8A8, with x_scale [M] or [1])."""
    if x_scale is not None:
        x_scale = jnp.broadcast_to(jnp.asarray(x_scale, jnp.float32).reshape(-1), (x.shape[0],))
    return _launch(x, weight, x_scale, bias, plan=plan, fmt_name=fmt_name, out_dtype=jnp.dtype(out_dtype))


def _column_group(weight: PreparedWeight) -> int | None:
    """The int4 group size the kernels take (None: per channel, or a format without column groups)."""
    return weight.group_size if FORMATS[weight.kind].column_groups else None


def _col(v, n: int, np_: int):
    return None if v is None else pad2d(jnp.asarray(v, jnp.float32).reshape(1, n), 1, np_)


@functools.partial(jax.jit, static_argnames=("plan", "fmt_name", "out_dtype"))
def _launch(x, weight: PreparedWeight, x_scale, bias, *, plan: KernelPlan, fmt_name: str, out_dtype):
    fmt = FORMATS[fmt_name]
    if plan.is_reference or (plan.variant is not None and plan.variant.name == "xla"):
        if plan.is_reference:
            return _reference(x, weight, x_scale, bias, fmt_name, out_dtype)
        return gpu_prefill.xla_matmul(x, weight, fmt_name, x_scale, bias, out_dtype)
    (m, k), n, t = x.shape, weight.n, plan.tiling
    tm = 1 if plan.variant is not None and plan.variant.name == "gemv" else t.tm
    mp, kp, np_ = round_up(m, tm), round_up(k, t.tk), round_up(n, t.tn)
    width = kp // 2 if fmt.packed else kp
    w = pad2d(weight.w, np_, width)
    xp = pad2d(x, mp, kp)
    x_parts = split_even_odd_columns(xp) if fmt.packed else (xp,)
    xs = None if x_scale is None else pad2d(x_scale.reshape(m, 1), mp, 1)
    ws = _col(weight.scale, n, np_) if fmt.channel_scale else None
    scales = zero = None
    if fmt.step_scales:
        per_step = FORMATS[weight.kind].column_groups and weight.group_size is None
        columns = 1 if per_step else kp // (weight.group_size or NF4_BLOCK_SIZE)
        scales = pad2d(weight.scale, np_, columns)
        zero = None if weight.zero is None else pad2d(weight.zero, np_, columns)
    variant = plan.variant
    if variant is None or variant.name == "tiled":
        y = _tiled(plan, fmt_name, weight, x_parts, w, scales, zero, xs, ws, _col(bias, n, np_), np_, kp,
                   out_dtype)
    elif variant.name == "pipelined":
        y = gpu_prefill.pipelined_matmul(x_parts, w, scales, zero, xs, ws, _col(bias, n, np_), fmt_name=fmt_name,
                                         tiling=t, group_size=_column_group(weight),
                                         out_dtype=out_dtype, group_m=variant.group_m, num_warps=variant.num_warps,
                                         num_stages=variant.num_stages, interpret=plan.interpret)
    else:
        partials = gpu_decode.split_partials(
            x_parts, w, scales, zero, fmt_name=fmt_name, tiling=t, split=variant.split, mode=variant.name,
            group_size=_column_group(weight), num_warps=variant.num_warps,
            num_stages=variant.num_stages, interpret=plan.interpret)
        y = gpu_decode.epilogue(partials, fmt_name, xs, ws, _col(bias, n, np_), out_dtype)
    return y[:m, :n]


def _tiled(plan, fmt_name, weight, x_parts, w, scales, zero, xs, ws, bias, np_, kp, out_dtype):
    """gpu_dense's (or, on TPU and in interpret mode, tpu_dense's) kernel on the prepared operands."""
    gpu = plan.backend == "gpu"
    has_bias = bias is not None
    bias = jnp.zeros((1, np_), jnp.float32) if bias is None else bias
    common = dict(tiling=plan.tiling, out_dtype=out_dtype, has_bias=has_bias, interpret=plan.interpret)
    module, suffix = (gpu_dense, "gpu") if gpu else (tpu_dense, "tpu")
    fmt = FORMATS[fmt_name]
    kernel = getattr(module, f"{fmt.op}_{suffix}")
    if fmt.codes_dot:
        return kernel(x_parts[0], w, xs, ws, bias, **common)
    if not fmt.step_scales:  # W8A16
        return kernel(x_parts[0], w, ws, bias, **common)
    if fmt.lookup:
        return kernel(*x_parts, w, scales, bias, **common)
    tk, group = plan.tiling.tk, weight.group_size or plan.tiling.tk

    def per_tile(columns):  # the kernels take one scale (and zero point) column per K tile; TPU's [K tiles, N, groups]
        if weight.group_size is None:
            columns = jnp.broadcast_to(columns, (np_, kp // tk))
        return columns if gpu else jnp.moveaxis(columns.reshape(np_, kp // tk, tk // group), -2, -3)

    return kernel(*x_parts, w, per_tile(scales), bias, **common, zeros=None if zero is None else per_tile(zero))


def _reference(x, weight: PreparedWeight, x_scale, bias, fmt_name: str, out_dtype):
    """reference.py's function of the weight's kernel (the contract), codes unpacked where it takes codes."""
    fmt = FORMATS[fmt_name]
    function = getattr(reference, f"{fmt.op}_reference")
    if fmt.codes_dot:
        return function(x, weight.w, x_scale, weight.scale, bias=bias, out_dtype=out_dtype)
    if not fmt.step_scales:  # W8A16
        return function(x, weight.w, weight.scale, bias=bias, out_dtype=out_dtype)
    if fmt.lookup:
        return reference.nf4_matmul_reference(x, weight.w.reshape(-1), weight.scale.reshape(-1),
                                              shape=(weight.n, weight.k), bias=bias, out_dtype=out_dtype)
    codes = jnp.stack(int4_nibbles(weight.w.astype(jnp.int32)), axis=-1).reshape(weight.n, weight.k)
    return reference.int4_weight_matmul_reference(x, codes.astype(jnp.int8), weight.scale,
                                                  group_size=weight.group_size, bias=bias, out_dtype=out_dtype,
                                                  w_zero=weight.zero)
