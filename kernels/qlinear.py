"""QArray adapters: run a quantized linear layer through the right kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qconvert.kernels.errors import KernelArgumentError
from qconvert.formats import QArray
from qconvert.kernels.activations import quantize_activations
from qconvert.kernels.dense import int8_matmul, int8_weight_matmul, nf4_matmul

ACT_MODES = (None, "dynamic", "static")


def qlinear(x, q: QArray, bias=None, *, act: str | None = None, input_scale=None, out_dtype=None,
            backend: str = "auto", return_plan: bool = False):
    """y = x @ W^T (+ bias) for a quantized weight W [out, in] held in a QArray.

    x [..., in] float. NF4 QArrays go to nf4_matmul; int8 QArrays go to
    int8_weight_matmul (act=None, W8A16) or, for W8A8, through
    quantize_activations (act="dynamic": per token; act="static": the
    calibrated per-tensor input_scale) into int8_matmul. out_dtype defaults to x's.
    """
    if act not in ACT_MODES:
        raise KernelArgumentError(f"qlinear: act must be None, 'dynamic' or 'static', got {act!r}")
    if len(q.shape) != 2:
        raise KernelArgumentError(f"qlinear: the weight must be [out, in], got a QArray of shape {q.shape}")
    x = jnp.asarray(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if q.kind == "nf4":
        if act is not None:
            raise KernelArgumentError("qlinear: NF4 weights take float activations; drop act")
        result = nf4_matmul(x2, q.qvalue, q.scale, shape=q.shape, blocksize=q.block_size, bias=bias,
                            out_dtype=out_dtype, backend=backend, return_plan=True)
    else:
        if q.zero_point is not None:
            raise KernelArgumentError("qlinear: int8 weights must be symmetric (no zero point)")
        w_scale = jnp.asarray(q.scale).reshape(-1)
        if w_scale.shape[0] != q.shape[0]:
            raise KernelArgumentError(f"qlinear: int8 weights need one scale per output channel ({q.shape[0]}), "
                                      f"got scale shape {jnp.shape(q.scale)}")
        if act is None:
            result = int8_weight_matmul(x2, q.qvalue, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                                        return_plan=True)
        else:
            if (act == "static") != (input_scale is not None):
                raise KernelArgumentError("qlinear: act='static' needs input_scale, and only it takes one")
            x_q, x_scale = quantize_activations(x2, input_scale)
            result = int8_matmul(x_q, q.qvalue, x_scale, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                                 return_plan=True)
    y, plan = result
    y = y.reshape(*lead, q.shape[0])
    return (y, plan) if return_plan else y
