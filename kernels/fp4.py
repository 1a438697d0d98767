"""The FP4 weight-only matmul (NVFP4A16, MXFP4A16): check, plan, pad, launch, slice.

The weight is E2M1 codes (uint8 0..15 at the logical [N, K] shape, bit 3 the
sign) with one float32 scale per group of `group_size` input columns (NVFP4: an
E4M3 value in groups of 16, over a float32 global scale per tensor; MXFP4: a
power of two in groups of 32). The launch divides the group scales by the
global scale once, in float32 (what compressed-tensors and the reference
compute), and packs the codes two to a byte as the int4 kernels read them, so
the TPU and GPU kernels are the int4 ones with the E2M1 table as their decode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qconvert.kernels import gpu_dense, reference, tpu_dense
from qconvert.kernels.checks import check_fp4_weight_matmul
from qconvert.kernels.plan import KernelPlan, KernelProblem, Tiling, dtype_name, plan_result, select_kernel
from qconvert.kernels.tiles import int4_weight_operands, pad2d, round_up, split_even_odd_columns

OP = "fp4_weight_matmul"


def effective_scale(w_scale, w_global) -> jax.Array:
    """Each group's float32 scale over the global scale (the quotient in float32, as compressed-tensors divides
    it); the scale itself without one (MXFP4)."""
    scale = jnp.asarray(w_scale, jnp.float32)
    if w_global is None:
        return scale
    return scale / jnp.asarray(w_global, jnp.float32).reshape(())


def expert_scales(w_scale, w_global) -> jax.Array:
    """Stacked experts' group scales [G, N, K/group] each over its own expert's global scale (w_global: G
    values), the quotient in float32 as effective_scale's; the scales themselves without one (MXFP4)."""
    scale = jnp.asarray(w_scale, jnp.float32)
    if w_global is None:
        return scale
    return scale / jnp.asarray(w_global, jnp.float32).reshape(-1, 1, 1)


@functools.partial(jax.jit, static_argnames=("plan", "group_size", "out_dtype"))
def _fp4_weight_matmul_launch(x, w_codes, w_scale, w_global, bias, *, plan: KernelPlan, group_size: int,
                              out_dtype):
    (m, k), n = x.shape, w_codes.shape[0]
    t = plan.tiling
    mp, kp, np_ = round_up(m, t.tm), round_up(k, t.tk), round_up(n, t.tn)
    gpu = plan.backend == "gpu"
    w_bytes, scales = int4_weight_operands(w_codes, effective_scale(w_scale, w_global), group_size, np_, kp, t.tk,
                                           tpu_layout=not gpu)
    x_even, x_odd = split_even_odd_columns(pad2d(jnp.asarray(x), mp, kp))
    bias_row = pad2d((jnp.zeros((n,), jnp.float32) if bias is None
                      else jnp.asarray(bias, jnp.float32).reshape(-1)).reshape(1, n), 1, np_)
    kernel = gpu_dense.fp4_weight_matmul_gpu if gpu else tpu_dense.fp4_weight_matmul_tpu
    y = kernel(x_even, x_odd, w_bytes, scales, bias_row, tiling=t, out_dtype=out_dtype, has_bias=bias is not None,
               interpret=plan.interpret)
    return y[:m, :n]


def fp4_weight_matmul(x, w_codes, w_scale, *, group_size: int, w_global=None, bias=None, out_dtype=jnp.float32,
                      backend: str = "auto", tiling: Tiling | None = None, return_plan: bool = False):
    """NVFP4A16 / MXFP4A16 matmul: y = x @ W^T + bias[n], W [N, K] = E2M1[w_codes] * (w_scale / w_global).

    x float [M, K] (bf16/f16/f32); w_codes uint8 [N, K] E2M1 codes; w_scale float [N, K/group_size];
    w_global the tensor's float32 global scale (NVFP4) or None (MXFP4). The kernels decode each code with the
    exact E2M1 table, multiply it by its group's scale over the global scale in float32, cast to x's dtype and
    accumulate in float32 (fp4_weight_matmul_reference's contract). Group sizes other than 16 and 32 run the
    reference and say so in the plan.
    """
    m, k, n = check_fp4_weight_matmul(x, w_codes, w_scale, group_size, w_global, bias, out_dtype)
    problem = KernelProblem(OP, m, k, n, dtype_name(x.dtype), dtype_name(out_dtype), group_size=int(group_size))
    plan = select_kernel(problem, backend, tiling)
    if plan.is_reference:
        y = reference.fp4_weight_matmul_reference(x, w_codes, w_scale, group_size=group_size, w_global=w_global,
                                                  bias=bias, out_dtype=out_dtype)
        return plan_result(y, plan, return_plan)
    y = _fp4_weight_matmul_launch(x, w_codes, w_scale, w_global, bias, plan=plan, group_size=int(group_size),
                                  out_dtype=jnp.dtype(out_dtype))
    return plan_result(y, plan, return_plan)
