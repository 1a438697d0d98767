"""The FP4 grouped (MoE) matmul: NVFP4A16 and MXFP4A16 experts from their codes, scales and global scales.

The experts' E2M1 codes [G, N, K] (uint8 0..15, bit 3 the sign) carry one float32 scale per group of
`group_size` input columns (NVFP4: E4M3 values in groups of 16, over a float32 global scale per expert;
MXFP4: powers of two in groups of 32). grouped_matmul runs them as an fp4 QArray of logical shape (G, N, K):
each expert's group scales are divided by its global scale once, in float32 (what compressed-tensors and the
reference compute), the codes are packed two a byte as int4's, and the TPU (Mosaic) and GPU (Triton) grouped
kernels decode each code with the exact E2M1 table times its group's scale inside the kernel, then
accumulate in float32; reference.fp4_grouped_matmul_reference is the contract.
"""

from __future__ import annotations

import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.kernels.checks import dtype_of
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.grouped import grouped_matmul

OP = "grouped_matmul"


def fp4_experts(w_codes, w_scale, *, group_size: int, w_global=None, dtype="bfloat16") -> QArray:
    """The stacked FP4 experts as grouped_matmul takes them: an fp4 QArray (G, N, K) whose zero_point slot holds
    each expert's global scale [G, 1, 1] (NVFP4), or None (MXFP4). grouped_matmul checks the parts."""
    w_codes = jnp.asarray(w_codes)
    if w_codes.ndim != 3:
        raise KernelArgumentError(f"{OP}: fp4 rhs codes must be [G, N, K], got shape {w_codes.shape} "
                                  f"{dtype_of(w_codes)}")
    w_global = None if w_global is None else jnp.asarray(w_global).reshape(-1, 1, 1)
    return QArray(w_codes, jnp.asarray(w_scale), w_global, kind="fp4", block_size=group_size, shape=w_codes.shape,
                  dtype=dtype)


def fp4_grouped_matmul(lhs, w_codes, w_scale, group_sizes, *, group_size: int, w_global=None,
                       preferred_element_type=jnp.float32, group_offset=None, tiling=None, backend: str = "auto",
                       interpret: bool = False, return_plan: bool = False, variant=None):
    """out[rows of group g] = lhs[rows of g] @ W[g - group_offset]^T, W[e] = E2M1[w_codes[e]] * (w_scale[e] /
    w_global[e]) (without w_global: the scale itself).

    lhs float [M, K], rows sorted by expert; w_codes uint8 [G, N, K]; w_scale float [G, N, K/group_size];
    w_global G float32 values or None; group_sizes int32 [num_groups]. Rows of no local expert are 0. The other
    arguments are grouped_matmul's (backend "cpu" or interpret=True: the Mosaic kernel in interpret mode;
    "gpu": the Triton kernel, or its GEMV variant; "xla": the reference).
    """
    rhs = fp4_experts(w_codes, w_scale, group_size=group_size, w_global=w_global)
    return grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, tiling=tiling,
                          group_offset=group_offset, transpose_rhs=True, interpret=interpret, backend=backend,
                          return_plan=return_plan, variant=variant)
