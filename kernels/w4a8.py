"""W4A8-FP8 (int4 weights, E4M3 activations per token): the rounding ahead of the int4 kernels, dense and grouped.

Each token's activations are rounded to E4M3 first (activations.quantize_fp8_activations: scale max|x| / 448,
x / scale cast to float8_e4m3fn); the existing W4A16 kernels then run on those E4M3 values, held exactly in
float32 (every E4M3 value is a float32), and each output row is multiplied by its token's scale afterwards,
then the bias is added: y = (e4m3(x / s) @ W^T) * s[m] + bias[n]. The int4 kernels are unchanged: on TPU the
E4M3 values reach the MXU as float32 tiles (v5e's MXU has no FP8), on GPU Triton's dot runs on them, and on
CPU the TPU kernels run in interpret mode or XLA runs the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qconvert.kernels.activations import e4m3_rows, rescale_rows
from qconvert.kernels.dense import int4_weight_matmul
from qconvert.kernels.grouped import grouped_matmul


def w4a8_fp8_matmul(x, w_codes, w_scale, *, group_size: int | None, bias=None, out_dtype=jnp.float32,
                    backend: str = "auto", return_plan: bool = False):
    """W4A8-FP8 matmul: y[m, n] = (sum_k e4m3(x[m, k] / s[m]) W[n, k]) * s[m] + bias[n], s[m] = max|x[m]| / 448.

    x float [M, K]; w_codes int8 [N, K] in [-8, 7]; w_scale [N, K/group_size] (int4_weight_matmul's operands).
    The sum is int4_weight_matmul's (float32 accumulation) on the E4M3 values; the plan returned is its.
    """
    x_e4m3, x_scale = e4m3_rows(x)
    y, plan = int4_weight_matmul(x_e4m3, w_codes, w_scale, group_size=group_size, out_dtype=jnp.float32,
                                 backend=backend, return_plan=True)
    y = rescale_rows(y, x_scale, bias, out_dtype)
    return (y, plan) if return_plan else y


def w4a8_fp8_grouped_matmul(x, rhs, group_sizes, *, backend: str = "auto", return_plan: bool = False):
    """Rows of x [M, K] sorted by expert, rounded to E4M3 per token, times each expert's int4 weight.

    rhs: the experts' stacked int4 QArray of logical shape (G, N, K) (qlinear.stack_experts); float32 out.
    """
    x_e4m3, x_scale = e4m3_rows(x)
    y, plan = grouped_matmul(x_e4m3, rhs, group_sizes, transpose_rhs=True, backend=backend, return_plan=True)
    y = rescale_rows(y, x_scale, None, jnp.float32)
    return (y, plan) if return_plan else y
