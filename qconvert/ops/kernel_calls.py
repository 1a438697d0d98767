"""Handing plain matmuls on QArrays to the Pallas kernels, through kernels.qlinear (the one router).

A "plain matmul" is lhs [..., K] contracted on its last dim with a 2-D rhs,
no batch dims; the leading lhs dims fold into M. The kernels take the weight
as [N, K] (nn.Linear layout) and rescale in the order the integer path uses,
so the int8 kernel and the int8_int32 path agree bit for bit.

By default kernels run where Pallas compiles natively (TPU, GPU). On CPU
Pallas only interprets the TPU kernel, which is far slower than XLA's own int8
dot, so there the XLA paths are chosen; `use_kernels("cpu")` forces the
interpreted kernels (for tests), `use_kernels(None)` turns kernels off.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import QConvertError
from qconvert.formats.qarray import QArray
from qconvert.ops.shapes import MatmulForm, is_prepared, operand_shape

_KERNEL_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("qconvert_ops_kernels", default="auto")


@contextlib.contextmanager
def use_kernels(backend: str | None) -> Iterator[None]:
    """Within the block, run plain matmuls on this kernel backend ('auto', 'tpu', 'gpu', 'cpu'), or none (None)."""
    token = _KERNEL_BACKEND.set(backend)
    try:
        yield
    finally:
        _KERNEL_BACKEND.reset(token)


class PreparedWeightError(QConvertError):
    """A prepared weight (kernels.prepared.PreparedWeight) used where only its QArray works."""

    exit_code = 2


PREPARED_ONLY_LINEAR = ("a prepared weight (qconvert.load(..., prepare=True)) runs only as x [..., in] . W^T with "
                        "a float x, as ops.linear calls it; pass its QArray (load without prepare) to other ops")


def _kernels():
    import qconvert.kernels as kernels

    return kernels


def kernel_backend() -> tuple[str | None, str | None]:
    """(backend to pass to the kernels, or None with the reason no kernel runs)."""
    setting = _KERNEL_BACKEND.get()
    if setting is None:
        return None, "kernels are turned off (use_kernels(None))"
    resolved = _kernels().resolve_backend(setting)
    if setting == "auto" and resolved == "xla":
        return None, "on CPU Pallas only interprets; XLA's dot is the faster path here"
    return resolved, None


def _rows(x_shape) -> int:
    return math.prod(x_shape[:-1])


def int8_kernel_blocker(lhs: QArray, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the W8A8 kernel cannot take this matmul, or None when it can (scales already factor out)."""
    backend, reason = kernel_backend()
    if backend is None:
        return reason
    if _rows(operand_shape(lhs)) == 0 or 0 in operand_shape(rhs):
        return "an empty operand"
    return None


def _weight_only_blocker(lhs, rhs: QArray, form: MatmulForm) -> str | None:
    """Why a weight-only kernel (W8A16, NF4, W4A16) cannot take float lhs x this weight, or None when it can."""
    backend, reason = kernel_backend()
    if backend is None:
        return reason
    if form.rhs_layout != "nk":
        return f"the {rhs.kind} weight is contracted on its first axis; the kernel takes [N, K] contracted on K"
    if rhs.kind.int8 and (rhs.zero_point is not None or rhs.scale.ndim != 2 or rhs.scale.shape[1] != 1):
        return "the weight scale is not one per output channel"
    if rhs.kind.column_groups and (rhs.scale.ndim != 2 or (rhs.zero_point is not None
                                                          and jnp.shape(rhs.zero_point) != jnp.shape(rhs.scale))):
        return "the int4 weight's scales (or zero points) are not [N, groups]"
    if jnp.result_type(lhs) != jnp.dtype(rhs.dtype):
        return f"activation dtype {jnp.result_type(lhs)} differs from the weight's {rhs.dtype}"
    if _rows(operand_shape(lhs)) == 0 or 0 in operand_shape(rhs):
        return "an empty operand"
    return None


def int8_weight_kernel_blocker(lhs, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the W8A16 kernel cannot take float lhs x int8 weight, or None when it can."""
    return _weight_only_blocker(lhs, rhs, form)


def nf4_kernel_blocker(lhs, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the NF4 kernel cannot take float lhs x NF4 weight, or None when it can."""
    return _weight_only_blocker(lhs, rhs, form)


def int4_weight_kernel_blocker(lhs, rhs: QArray, form: MatmulForm) -> str | None:
    """Why the W4A16 kernel cannot take float lhs x int4 weight, or None when it can."""
    return _weight_only_blocker(lhs, rhs, form)


def int8_matmul(lhs: QArray, rhs: QArray, form: MatmulForm, out_dtype) -> jax.Array:
    """lhs int8 [..., K] (scale [..., 1]) times rhs int8 [K, N] or [N, K] through the W8A8 kernel."""
    w_q = rhs.qvalue if form.rhs_layout == "nk" else rhs.qvalue.T
    n, k = w_q.shape
    w_scale = jnp.broadcast_to(jnp.asarray(rhs.scale, jnp.float32).reshape(-1), (n,)).reshape(n, 1)
    weight = QArray(w_q, w_scale, kind="int8", shape=(n, k), dtype=rhs.dtype)
    backend, _ = kernel_backend()
    return _kernels().qlinear(lhs, weight, out_dtype=out_dtype, backend=backend)


def _with_dequantized_grad(kernel_fn, lhs, rhs: QArray):
    """kernel_fn(x, weight) with d/dx given by x's cotangent g @ W (W dequantized, its zero point included).

    Pallas kernels have no autodiff rule; the weight payload gets no gradient.
    """
    def weight_of(qvalue, scale, zero):
        return QArray(qvalue, scale, zero, kind=rhs.kind, block_size=rhs.block_size, shape=rhs.shape,
                      dtype=rhs.dtype)

    @jax.custom_vjp
    def matmul(x, qvalue, scale, zero):
        return kernel_fn(x, weight_of(qvalue, scale, zero))

    def fwd(x, qvalue, scale, zero):
        return kernel_fn(x, weight_of(qvalue, scale, zero)), (qvalue, scale, zero)

    def bwd(residuals, g):
        qvalue, scale, zero = residuals
        weight = weight_of(qvalue, scale, zero)
        dx = jnp.matmul(g.astype(jnp.float32), weight.dequantize(jnp.float32)).astype(jnp.result_type(lhs))
        return dx, _no_gradient(qvalue), jnp.zeros_like(scale), None if zero is None else _no_gradient(zero)

    matmul.defvjp(fwd, bwd)
    return matmul(lhs, rhs.qvalue, rhs.scale, rhs.zero_point)


def _no_gradient(a):
    """The zero cotangent of a weight operand: float0 for integer codes or zero points, zeros for floats."""
    if jnp.issubdtype(jnp.result_type(a), jnp.floating):
        return jnp.zeros_like(a)
    return np.zeros(jnp.shape(a), jax.dtypes.float0)


def int8_weight_matmul(lhs, rhs: QArray, out_dtype) -> jax.Array:
    """Float lhs [..., K] times an int8 weight [N, K] with per-channel scale through the W8A16 kernel."""
    return _weight_only_matmul(lhs, rhs, out_dtype)


def nf4_matmul(lhs, rhs: QArray, out_dtype) -> jax.Array:
    """Float lhs [..., K] times an NF4 weight [N, K] through the NF4 kernel."""
    return _weight_only_matmul(lhs, rhs, out_dtype)


def int4_weight_matmul(lhs, rhs: QArray, out_dtype) -> jax.Array:
    """Float lhs [..., K] times an int4 weight [N, K] (group or per-channel scales) through the W4A16 kernel."""
    return _weight_only_matmul(lhs, rhs, out_dtype)


def _weight_only_matmul(lhs, rhs: QArray, out_dtype) -> jax.Array:
    """Float lhs [..., K] times a quantized weight [N, K] through its kind's kernel (kernels.qlinear routes it)."""
    backend, _ = kernel_backend()

    def run(x, weight):
        return _kernels().qlinear(x, weight, out_dtype=out_dtype, backend=backend)

    return _with_dequantized_grad(run, lhs, rhs)


def prepared_matmul(lhs, weight, out_dtype) -> jax.Array:
    """Float lhs [..., K] times a prepared weight [N, K] as it is (nothing packed on the call): its kernel where
    kernels run, else the kernels' XLA reference. Inference only: a gradient through it raises
    PreparedWeightError."""
    backend, _ = kernel_backend()

    @jax.custom_vjp
    def matmul(x, prepared):
        return _kernels().qlinear(x, prepared, out_dtype=out_dtype, backend=backend or "xla")

    def fwd(x, prepared):
        return matmul(x, prepared), None

    def bwd(_, g):
        # Pallas kernels have no autodiff rule, and the packed codes are no parameter to train.
        raise PreparedWeightError("a prepared weight is inference-only: no gradient flows through it; load with "
                                  "prepare=False (QArray weights) to differentiate, or ops.ste for training")

    matmul.defvjp(fwd, bwd)
    return matmul(lhs, weight)
