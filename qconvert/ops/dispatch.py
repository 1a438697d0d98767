"""Which way a quantized op computes: the one place that chooses, and a record of the choices.

Every op in qconvert.ops asks `choose_path` once per call (at trace time under
jit) and then follows the answer:

  int8_kernel  both operands int8 QArrays whose scales factor out of the
               contraction and the shape is a plain matmul: the Pallas int8
               kernel (int32 accumulation, scales applied to the output).
  int8_int32   both operands int8 QArrays whose scales factor out of the
               contraction: the same jax.lax op on the int8 payloads with int32
               accumulation, then the two scales applied to the output. Exact.
  int8_weight_kernel
               a per-channel int8 weight times a float activation of the same
               dtype, plain matmul: the Pallas W8A16 kernel.
  nf4_kernel   an NF4 weight times a float activation of the same dtype, plain
               matmul: the Pallas NF4 kernel, which decodes tile by tile.
  int4_weight_kernel
               a symmetric int4 weight (group or per-channel scales) times a
               float activation of the same dtype, plain matmul: the Pallas
               W4A16 kernel, which unpacks nibbles tile by tile.
  prepared     a prepared weight (qconvert.load(..., prepare=True)) times a
               float activation, x . W^T: kernels.prepared_matmul on the
               operand as it was laid out at load time (its kernel where
               kernels run, else the kernels' XLA reference); nothing is packed.
  dequantize   everything else: dequantize the QArray operand(s) to their float
               dtype and run the jax.lax op; XLA fuses the dequantization.
               An fp8 weight always takes it here: an op multiplies the
               weight's values by the activation as it is, while the fp8
               kernel quantizes the activation to E4M3 first (that is
               kernels.qlinear with act="dynamic", what verify runs).

`record_paths()` collects the decisions made inside it, so a caller (or a test)
can see which path each op took.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import jax.numpy as jnp

from qconvert.formats.qarray import QArray
from qconvert.ops import kernel_calls
from qconvert.ops.shapes import MatmulForm, operand_shape

INT8_KERNEL = "int8_kernel"
INT8_INT32 = "int8_int32"
INT8_WEIGHT_KERNEL = "int8_weight_kernel"
NF4_KERNEL = "nf4_kernel"
INT4_WEIGHT_KERNEL = "int4_weight_kernel"
PREPARED = "prepared"
DEQUANTIZE = "dequantize"
PATHS = (INT8_KERNEL, INT8_INT32, INT8_WEIGHT_KERNEL, NF4_KERNEL, INT4_WEIGHT_KERNEL, PREPARED, DEQUANTIZE)


@dataclasses.dataclass(frozen=True)
class PathDecision:
    """One op's choice: which path it took and why the faster ones did not apply."""

    op: str
    path: str
    reason: str
    lhs: str
    rhs: str


_RECORDERS: contextvars.ContextVar[tuple[list[PathDecision], ...]] = contextvars.ContextVar(
    "qconvert_ops_recorders", default=()
)


@contextlib.contextmanager
def record_paths() -> Iterator[list[PathDecision]]:
    """Collect the PathDecision of every qconvert.ops call made inside the block.

    Decisions are made while tracing, so a jitted function records them on its
    first (tracing) call only.
    """
    decisions: list[PathDecision] = []
    token = _RECORDERS.set(_RECORDERS.get() + (decisions,))
    try:
        yield decisions
    finally:
        _RECORDERS.reset(token)


def describe(x) -> str:
    """A short text for an operand: 'int8 QArray[4, 8]' or 'float32[4, 8]'."""
    if isinstance(x, QArray):
        return f"{x.kind} QArray{list(operand_shape(x))}"
    if kernel_calls.is_prepared(x):
        return f"prepared {x.kind}[{x.n}, {x.k}]"
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def _int8_blocker(x, contracting: Sequence[int], side: str) -> str | None:
    """Why `x` cannot enter the integer path, or None when it can."""
    if not isinstance(x, QArray):
        return f"{side} is not quantized"
    if not x.kind.int8:
        return f"{side} is {x.kind}, not int8"
    if x.zero_point is not None:
        return f"{side} has a zero point"
    scale_shape = tuple(x.scale.shape)
    if len(scale_shape) != len(x.qvalue.shape):
        return f"{side} scale rank {len(scale_shape)} differs from its value rank {len(x.qvalue.shape)}"
    shared = [d for d in contracting if scale_shape[d] != 1]
    if shared:
        return f"{side} scale varies along contracting dims {shared}, so it does not factor out"
    return None


def choose_path(
    op: str,
    lhs,
    rhs,
    *,
    lhs_contracting: Sequence[int],
    rhs_contracting: Sequence[int],
    out_dtype,
    matmul_form: MatmulForm | None = None,
    int8_blocker: str | None = None,
) -> PathDecision:
    """Decide how `op` computes for these operands, and record the decision.

    `lhs_contracting`/`rhs_contracting` are the dims summed over (a scale must be
    size 1 there to factor out); `matmul_form` is given when the op is a plain
    2-D matmul that a kernel can take; `int8_blocker` lets an op veto the
    integer path for a reason of its own (e.g. an unsupported group_offset).
    """
    path, reason = _decide(
        lhs, rhs, lhs_contracting, rhs_contracting, jnp.dtype(out_dtype), matmul_form, int8_blocker
    )
    decision = PathDecision(op=op, path=path, reason=reason, lhs=describe(lhs), rhs=describe(rhs))
    for decisions in _RECORDERS.get():
        decisions.append(decision)
    return decision


def _decide(lhs, rhs, lhs_contracting, rhs_contracting, out_dtype, matmul_form, int8_blocker):
    if kernel_calls.is_prepared(rhs):  # dot_general lets a prepared weight in only as x . W^T
        backend, reason = kernel_calls.kernel_backend()
        if backend is None:
            return PREPARED, f"prepared {rhs.kind} weight; the kernels' XLA reference: {reason}"
        return PREPARED, f"prepared {rhs.kind} weight; its {backend} kernel"
    if not isinstance(lhs, QArray) and not isinstance(rhs, QArray):
        return DEQUANTIZE, "no quantized operand"
    if not jnp.issubdtype(out_dtype, jnp.floating):
        return DEQUANTIZE, f"output dtype {out_dtype} is not floating"
    blocker = (
        _int8_blocker(lhs, lhs_contracting, "lhs")
        or _int8_blocker(rhs, rhs_contracting, "rhs")
        or int8_blocker
    )
    if blocker is None:
        if matmul_form is not None:
            kernel_blocker = kernel_calls.int8_kernel_blocker(lhs, rhs, matmul_form)
            if kernel_blocker is None:
                return INT8_KERNEL, "int8 x int8, scales factor out, plain matmul"
            return INT8_INT32, f"int8 x int8, scales factor out; no kernel: {kernel_blocker}"
        return INT8_INT32, "int8 x int8, scales factor out of the contraction"
    if matmul_form is not None and isinstance(rhs, QArray) and not isinstance(lhs, QArray):
        if rhs.kind.flat_blocks:
            kernel_blocker = kernel_calls.nf4_kernel_blocker(lhs, rhs, matmul_form)
            if kernel_blocker is None:
                return NF4_KERNEL, "float x nf4 weight, plain matmul"
        elif rhs.kind.column_groups:
            kernel_blocker = kernel_calls.int4_weight_kernel_blocker(lhs, rhs, matmul_form)
            if kernel_blocker is None:
                return INT4_WEIGHT_KERNEL, "float x int4 weight, plain matmul"
        elif rhs.kind.float_codes:
            kernel_blocker = ("the fp8 kernel quantizes the activation to E4M3 first (qlinear act='dynamic'); "
                              "this op multiplies it as it is")
        else:
            kernel_blocker = kernel_calls.int8_weight_kernel_blocker(lhs, rhs, matmul_form)
            if kernel_blocker is None:
                return INT8_WEIGHT_KERNEL, "float x per-channel int8 weight, plain matmul"
        return DEQUANTIZE, f"{blocker}; no {rhs.kind} weight kernel: {kernel_blocker}"
    return DEQUANTIZE, blocker
