"""The grouped (MoE) matmuls: check, plan, build group metadata, pad, launch, slice.

grouped_matmul(lhs, rhs, group_sizes) computes lhs[rows of group i] @ rhs[i] with
rhs in float, int8 per output channel (rhs_scale), or int8, fp8 (E4M3), NF4,
int4 or FP4 (a QArray of logical shape (G, N, K), one nn.Linear weight per
expert; FP4's E2M1 codes are decoded with their group scales, over each
expert's global scale for NVFP4, inside the kernels, as int4's codes are).
transposed_grouped_matmul is the weight-gradient form. Rows are sorted by
group, as an MoE router's sort gives.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import INT8, NF4_BLOCK_SIZE, QArray
from qconvert.kernels import gpu_grouped, gpu_grouped_decode, reference, tpu_grouped
from qconvert.kernels.checks import check_fp4_experts
from qconvert.kernels.checks import dtype_of as _dtype
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.fp4 import expert_scales
from qconvert.kernels.grouped_metadata import make_group_metadata
from qconvert.kernels.plan import FLOAT, KernelPlan, KernelProblem, Tiling, dtype_name, plan_result, select_kernel
from qconvert.kernels.tiles import decodes_e2m1, grouped_operands, int4_packed, pad_to, round_up

OP = "grouped_matmul"


def _check_common(op: str, lhs, group_sizes, preferred_element_type):
    lhs_dtype = _dtype(lhs)
    if jnp.ndim(lhs) != 2 or not jnp.issubdtype(lhs_dtype, jnp.floating):
        raise KernelArgumentError(f"{op}: lhs must be a rank-2 float array, got shape {jnp.shape(lhs)} "
                                  f"dtype {lhs_dtype}")
    # Read the caller's dtype before any conversion (JAX would narrow int64 silently).
    sizes_dtype = _dtype(group_sizes)
    if jnp.ndim(group_sizes) != 1 or sizes_dtype != jnp.int32:
        raise KernelArgumentError(f"{op}: group_sizes must be int32 [num_groups], got shape "
                                  f"{jnp.shape(group_sizes)} dtype {sizes_dtype}")
    if not jnp.issubdtype(jnp.dtype(preferred_element_type), jnp.floating):
        raise KernelArgumentError(f"{op}: preferred_element_type must be a float dtype, "
                                  f"got {jnp.dtype(preferred_element_type)}")


def _resolve_tiling(tiling, m, k, n):
    if callable(tiling):
        tiling = tiling(m, k, n)
        if tiling is None:
            return None, "the tiling function returned None for this shape"
    return (None if tiling is None else Tiling(*tiling)), None


def _int4_parts(rhs: QArray):
    """The checked codes [G, N, K] and float32 scales [G, N, K/group] (or [G, N, 1]) of an int4 QArray."""
    g, n, k = rhs.shape
    group = rhs.block_size
    if tuple(jnp.shape(rhs.qvalue)) != (g, n, k) or _dtype(rhs.qvalue) != jnp.int8:
        raise KernelArgumentError(f"{OP}: int4 rhs codes must be int8 [G, N, K] = {(g, n, k)}, got "
                                  f"{jnp.shape(rhs.qvalue)} {_dtype(rhs.qvalue)}")
    if group is not None and k % group:
        raise KernelArgumentError(f"{OP}: int4 rhs K={k} is not a multiple of its group size {group}")
    scale_shape = (g, n, 1 if group is None else k // group)
    if tuple(jnp.shape(rhs.scale)) != scale_shape:
        raise KernelArgumentError(f"{OP}: int4 rhs scale has shape {jnp.shape(rhs.scale)}; expected {scale_shape} "
                                  f"(group size {group})")
    if rhs.zero_point is not None and (tuple(jnp.shape(rhs.zero_point)) != scale_shape
                                       or not jnp.issubdtype(_dtype(rhs.zero_point), jnp.integer)):
        raise KernelArgumentError(f"{OP}: int4 rhs zero points must be integers shaped as its scales {scale_shape}, "
                                  f"got {jnp.shape(rhs.zero_point)} {_dtype(rhs.zero_point)}")
    return jnp.asarray(rhs.qvalue), jnp.asarray(rhs.scale, jnp.float32)


def _fp8_parts(rhs: QArray):
    """The checked E4M3 codes [G, N, K] and float32 per-channel scales [G, N] of an fp8 QArray."""
    g, n, k = rhs.shape
    if tuple(jnp.shape(rhs.qvalue)) != (g, n, k) or _dtype(rhs.qvalue) != jnp.float8_e4m3fn:
        raise KernelArgumentError(f"{OP}: fp8 rhs codes must be float8_e4m3fn [G, N, K] = {(g, n, k)}, got "
                                  f"{jnp.shape(rhs.qvalue)} {_dtype(rhs.qvalue)}")
    if jnp.size(rhs.scale) != g * n:
        raise KernelArgumentError(f"{OP}: fp8 rhs scale has shape {jnp.shape(rhs.scale)}; expected {(g, n, 1)} "
                                  "(one scale per expert and output channel)")
    return jnp.asarray(rhs.qvalue), jnp.asarray(rhs.scale, jnp.float32).reshape(g, n)


def _fp4_parts(rhs: QArray):
    """The checked E2M1 codes [G, N, K] and float32 scales [G, N, K/group] of an fp4 QArray, each expert's group
    scales over its own global scale (NVFP4's, in the zero_point slot; MXFP4 has none)."""
    check_fp4_experts(OP, rhs.qvalue, rhs.scale, rhs.zero_point, rhs.block_size, rhs.shape)
    return jnp.asarray(rhs.qvalue), expert_scales(rhs.scale, rhs.zero_point)


def _rhs_parts(lhs, rhs, rhs_scale, transpose_rhs):
    """(rhs_kind, codes/float rhs, scale or absmax, G, K, N, NF4 block or int4 group size) from the accepted
    rhs forms."""
    if isinstance(rhs, QArray):
        if len(rhs.shape) != 3 or not transpose_rhs:
            raise KernelArgumentError(f"{OP}: a QArray rhs must have logical shape (G, N, K) (one nn.Linear weight "
                                      f"per expert) with transpose_rhs=True, got shape {rhs.shape} "
                                      f"transpose_rhs={transpose_rhs}")
        g, n, k_w = rhs.shape
        if rhs.kind.flat_blocks:
            return rhs.kind, jnp.asarray(rhs.qvalue), jnp.asarray(rhs.scale, jnp.float32), g, k_w, n, rhs.block_size
        if rhs.kind.column_groups:
            return (rhs.kind, *_int4_parts(rhs), g, k_w, n, rhs.block_size)
        if decodes_e2m1(rhs.kind):
            return (rhs.kind, *_fp4_parts(rhs), g, k_w, n, rhs.block_size)
        if rhs.zero_point is not None:
            raise KernelArgumentError(f"{OP}: {rhs.kind} rhs must be symmetric (no zero point)")
        if rhs.kind.float_codes:
            return (rhs.kind, *_fp8_parts(rhs), g, k_w, n, None)
        return INT8, jnp.asarray(rhs.qvalue), jnp.asarray(rhs.scale, jnp.float32).reshape(g, n), g, k_w, n, None
    rhs = jnp.asarray(rhs)
    if rhs.ndim != 3:
        raise KernelArgumentError(f"{OP}: rhs must be rank 3 [G, K, N] ([G, N, K] with transpose_rhs), "
                                  f"got shape {rhs.shape}")
    g, a, b = rhs.shape
    k_w, n = (b, a) if transpose_rhs else (a, b)
    if rhs.dtype == jnp.int8:
        if rhs_scale is None or jnp.size(rhs_scale) != g * n:
            raise KernelArgumentError(f"{OP}: int8 rhs needs rhs_scale [G={g}, N={n}] (per output channel), "
                                      f"got {None if rhs_scale is None else jnp.shape(rhs_scale)}")
        return INT8, rhs, jnp.asarray(rhs_scale, jnp.float32).reshape(g, n), g, k_w, n, None
    if not jnp.issubdtype(rhs.dtype, jnp.floating):
        raise KernelArgumentError(f"{OP}: rhs must be float or int8 (or an NF4 or int4 QArray), got {rhs.dtype}")
    return FLOAT, rhs, None, g, k_w, n, None


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=jnp.float32, tiling=None,
                   group_offset=None, transpose_rhs: bool = False, interpret: bool = False, rhs_scale=None,
                   backend: str = "auto", return_plan: bool = False, variant=None):
    """out[rows of group g] = lhs[rows of g] @ rhs[g - group_offset] for an MoE layer.

    lhs float [M, K], rows sorted by group; group_sizes int32 [num_groups]
    (sum <= M); rhs one of: float [G, K, N] ([G, N, K] with transpose_rhs); int8
    codes of the same layouts with rhs_scale [G, N]; or a QArray ("int8", "fp8",
    "nf4", "int4" or "fp4") of logical shape (G, N, K) with transpose_rhs=True. int8
    and fp8 codes are cast exactly to lhs' dtype in the kernel and their
    per-channel scale multiplies each group's float32 sum. G may be a
    shard of the experts starting at group_offset. Rows of groups outside the shard, and
    rows past sum(group_sizes), are 0. tiling: (tm, tk, tn), a function of
    (m, k, n) returning one (or None to decline), or None to let the plan choose.
    interpret=True runs the TPU kernel in interpret mode (backend "cpu"); on
    backend "gpu" the Triton kernel runs, or the variant (gpu_tuning.Variant:
    "gemv", rhs [G, N, K] only) the tuned table or `variant` names.
    """
    _check_common(OP, lhs, group_sizes, preferred_element_type)
    lhs = jnp.asarray(lhs)
    rhs_kind, rhs_data, rhs_aux, g_local, k_w, n, blocksize = _rhs_parts(lhs, rhs, rhs_scale, transpose_rhs)
    # int4 with zero points (W4A16_ASYM): each code dequantizes to (q - zero) * scale.
    rhs_zero = rhs.zero_point if isinstance(rhs, QArray) and rhs.kind.column_groups else None
    m, k = lhs.shape
    if k_w != k:
        raise KernelArgumentError(f"{OP}: lhs has K={k} but rhs has K={k_w}; check transpose_rhs")
    num_groups = jnp.shape(group_sizes)[0]
    offset = 0 if group_offset is None else int(group_offset)
    if not 0 <= offset <= num_groups - g_local:
        raise KernelArgumentError(f"{OP}: group_offset={offset} with {g_local} local groups does not fit in "
                                  f"{num_groups} groups")
    problem = KernelProblem(OP, m, k, n, dtype_name(lhs.dtype), dtype_name(preferred_element_type),
                            blocksize if rhs_kind.flat_blocks else NF4_BLOCK_SIZE, num_groups, rhs_kind,
                            blocksize if int4_packed(rhs_kind) else None)
    plan = _grouped_plan(problem, tiling, interpret, backend, variant)
    if plan.variant is not None and plan.variant.name == "gemv" and not (transpose_rhs or rhs_kind.packs_nibbles):
        if variant is not None:
            raise KernelArgumentError(f"{OP}: the gemv variant reads rhs [G, N, K]; pass transpose_rhs=True")
        plan = dataclasses.replace(plan, variant=None)  # a tuned gemv entry for the other layout: the tiled kernel
    if plan.is_reference:
        y = _grouped_reference(lhs, rhs_kind, rhs_data, rhs_aux, group_sizes, g_local, k, n, blocksize,
                               preferred_element_type, offset, transpose_rhs, rhs_zero)
        return plan_result(y, plan, return_plan)
    y = _grouped_launch(lhs, rhs_data, rhs_aux, group_sizes, rhs_zero, plan=plan, rhs_kind=rhs_kind, offset=offset,
                        g_local=g_local, n=n, out_dtype=jnp.dtype(preferred_element_type), transpose_rhs=transpose_rhs,
                        group_size=blocksize if int4_packed(rhs_kind) else None)
    return plan_result(y, plan, return_plan)


# Jitted with the plan static: metadata, padding and layout run at trace time into
# one compiled call (an eager call pays the checks, a cached plan and one dispatch).
@functools.partial(jax.jit, static_argnames=("plan", "rhs_kind", "offset", "g_local", "n", "out_dtype",
                                             "transpose_rhs", "group_size"))
def _grouped_launch(lhs, rhs_data, rhs_aux, group_sizes, rhs_zero=None, *, plan: KernelPlan, rhs_kind: str,
                    offset: int, g_local: int, n: int, out_dtype, transpose_rhs: bool, group_size: int | None = None):
    gemv = plan.backend == "gpu" and plan.variant is not None and plan.variant.name == "gemv"
    if gemv and rhs_zero is None:  # the GEMV variant has no zero-point operand; the tiled kernel has
        v = plan.variant
        return gpu_grouped_decode.run_grouped_gemv(lhs, rhs_kind, rhs_data, rhs_aux, group_sizes, offset=offset,
                                                   num_local=g_local, n=n, tiling=plan.tiling, split=v.split,
                                                   out_dtype=out_dtype, group_size=group_size,
                                                   num_warps=v.num_warps, num_stages=v.num_stages)
    if plan.backend == "gpu":
        return gpu_grouped.run_grouped_matmul(lhs, rhs_kind, rhs_data, rhs_aux, group_sizes, offset=offset,
                                              num_local=g_local, n=n, tiling=plan.tiling, out_dtype=out_dtype,
                                              transpose_rhs=transpose_rhs, group_size=group_size, rhs_zero=rhs_zero)
    m, k = lhs.shape
    t = plan.tiling
    mp, kp, np_ = round_up(m, t.tm), round_up(k, t.tk), round_up(n, t.tn)
    metadata, num_tiles = make_group_metadata(group_sizes=group_sizes, m=mp, tm=t.tm, start_group=offset,
                                              num_nonzero_groups=g_local, visit_empty_groups=False)
    lhs_ops, rhs_ops = grouped_operands(pad_to(lhs, (mp, kp)), rhs_kind, rhs_data, rhs_aux, rhs_zero,
                                        num_local=g_local, n=n, k=k, np_=np_, kp=kp, tk=t.tk, group_size=group_size,
                                        transpose_rhs=transpose_rhs, tpu_layout=True)
    y = tpu_grouped.grouped_matmul_tpu(
        metadata, jnp.full((1,), offset, jnp.int32), num_tiles.reshape(1), lhs_ops, rhs_ops, tiling=t,
        out_dtype=out_dtype, rhs_kind=rhs_kind, transpose_rhs=transpose_rhs, interpret=plan.interpret)[:m, :n]
    return jnp.where(_local_rows(group_sizes, m, offset, g_local)[:, None], y, jnp.zeros_like(y))


def _local_rows(group_sizes, m: int, offset: int, g_local: int) -> jax.Array:
    """Which of the m rows belong to the groups [offset, offset + g_local)."""
    ends = jnp.cumsum(jnp.asarray(group_sizes, jnp.int32))
    first = jnp.where(offset > 0, ends[offset - 1], 0) if offset > 0 else 0
    rows = jnp.arange(m)
    return (rows >= first) & (rows < ends[offset + g_local - 1])


def _grouped_reference(lhs, rhs_kind, rhs_data, rhs_aux, group_sizes, g_local, k, n, blocksize, out_dtype, offset,
                       transpose_rhs, rhs_zero=None):
    if decodes_e2m1(rhs_kind):  # rhs_aux: the group scales already over each expert's global scale
        return reference.fp4_grouped_matmul_reference(lhs, rhs_data, rhs_aux, group_sizes, group_size=blocksize,
                                                      preferred_element_type=out_dtype, group_offset=offset)
    if rhs_kind.packs_nibbles:
        if rhs_kind.flat_blocks:
            dense = reference.nf4_dequantize_reference(rhs_data, rhs_aux, (g_local * n, k), blocksize)
        else:
            dense = reference.int4_dequantize_reference(rhs_data, rhs_aux, blocksize, rhs_zero)
        return reference.grouped_matmul_reference(lhs, dense.reshape(g_local, n, k).astype(lhs.dtype), group_sizes,
                                                  preferred_element_type=out_dtype, group_offset=offset,
                                                  transpose_rhs=True)
    return reference.grouped_matmul_reference(lhs, rhs_data, group_sizes, preferred_element_type=out_dtype,
                                              group_offset=offset, transpose_rhs=transpose_rhs,
                                              rhs_scale=rhs_aux)


def transposed_grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=jnp.float32, tiling=None,
                              group_offset=None, num_actual_groups: int | None = None, interpret: bool = False,
                              backend: str = "auto", return_plan: bool = False):
    """out[g] = lhs[:, cols of group g] @ rhs[rows of group g, :] (the MoE weight gradient).

    lhs float [K, M], rhs float [M, N], group_sizes int32 [num_groups]; returns
    [num_actual_groups, K, N] for the groups from group_offset on (all by
    default); empty groups give zeros. tiling is (tm, tk, tn) as in grouped_matmul.
    """
    op = "transposed_grouped_matmul"
    _check_common(op, lhs, group_sizes, preferred_element_type)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if rhs.ndim != 2 or not jnp.issubdtype(rhs.dtype, jnp.floating):
        raise KernelArgumentError(f"{op}: rhs must be a rank-2 float array [M, N], got shape {rhs.shape} "
                                  f"dtype {rhs.dtype}")
    k, m = lhs.shape
    if rhs.shape[0] != m:
        raise KernelArgumentError(f"{op}: lhs is [K, M={m}] but rhs has {rhs.shape[0]} rows; they must match")
    n = rhs.shape[1]
    num_groups = jnp.shape(group_sizes)[0]
    offset = 0 if group_offset is None else int(group_offset)
    count = num_groups - offset if num_actual_groups is None else int(num_actual_groups)
    if count <= 0 or offset < 0 or offset + count > num_groups:
        raise KernelArgumentError(f"{op}: group_offset={offset}, num_actual_groups={count} do not fit in "
                                  f"{num_groups} groups")
    problem = KernelProblem(op, m, k, n, dtype_name(lhs.dtype), dtype_name(preferred_element_type),
                            num_groups=num_groups)
    plan = _grouped_plan(problem, tiling, interpret, backend)
    if plan.is_reference:
        y = reference.transposed_grouped_matmul_reference(lhs, rhs, group_sizes,
                                                          preferred_element_type=preferred_element_type,
                                                          group_offset=offset, num_actual_groups=count)
        return plan_result(y, plan, return_plan)
    if plan.backend == "gpu":
        y = gpu_grouped.run_transposed_grouped_matmul(lhs, rhs, group_sizes, offset=offset, num_local=count,
                                                      tiling=plan.tiling, out_dtype=preferred_element_type)
        return plan_result(y, plan, return_plan)
    y = _transposed_tpu(lhs, rhs, group_sizes, plan, offset, count, preferred_element_type)
    return plan_result(y, plan, return_plan)


def _transposed_tpu(lhs, rhs, group_sizes, plan: KernelPlan, offset: int, count: int, out_dtype) -> jax.Array:
    """transposed_grouped_matmul through the TPU kernel: operands padded to the tiling, the result cut back."""
    (k, m), n, t = lhs.shape, rhs.shape[1], plan.tiling
    mp, kp, np_ = round_up(m, t.tm), round_up(k, t.tk), round_up(n, t.tn)
    metadata, num_tiles = make_group_metadata(group_sizes=group_sizes, m=mp, tm=t.tm, start_group=offset,
                                              num_nonzero_groups=count, visit_empty_groups=True)
    y = tpu_grouped.transposed_grouped_matmul_tpu(
        metadata, jnp.full((1,), offset, jnp.int32), num_tiles.reshape(1), pad_to(lhs, (kp, mp)),
        pad_to(rhs, (mp, np_)), tiling=t, out_dtype=jnp.dtype(out_dtype), num_local=count, interpret=plan.interpret)
    return y[:, :k, :n]


def _grouped_plan(problem: KernelProblem, tiling, interpret: bool, backend: str, variant=None) -> KernelPlan:
    """The plan of a grouped problem under `tiling` (see grouped_matmul); the reference where a tiling
    function declined the shape."""
    requested, declined = _resolve_tiling(tiling, problem.m, problem.k, problem.n)
    plan = select_kernel(problem, "cpu" if interpret else backend, requested, variant)
    if declined:
        plan = KernelPlan(problem.op, f"{problem.op}_reference", "reference", None, plan.guarantee,
                          fallback_reason=declined)
    return plan
