"""Quantized jax.lax / jax.numpy ops: either operand may be a jax.Array or a QArray.

    from qconvert import ops
    y = ops.dot_general(x, w_q, (((1,), (1,)), ((), ())))   # w_q: a QArray [out, in]

Each op returns what the jax.lax (or jax.numpy) op returns for the dequantized
operands (shape, dtype, preferred_element_type rules), computed by one of two
ways chosen in qconvert.ops.dispatch.choose_path: an exact integer path when
both operands are int8 with scales that factor out of the contraction (Pallas
kernels for plain matmuls), otherwise dequantize-then-compute (the NF4 or
int4 kernel for a plain matmul with an NF4 or int4 weight). `record_paths()`
shows the choices; `use_kernels(backend)` sets where the Pallas kernels run
(default: TPU/GPU only, since on CPU Pallas merely interprets).

Transformations: QArray is a pytree, so ops work under jax.jit (paths are
chosen while tracing), jax.grad (w.r.t. float operands; the kernel paths carry
their own VJP) and jax.vmap. int8 QArrays may be vmapped along any axis (shapes
are read from the payload); an NF4 QArray is packed flat, so it must stay
unbatched (in_axes=None) while the float operand is mapped.

A prepared weight (qconvert.load(OUT, prepare=True)) is laid out for its
kernel once; `linear` (x . W^T) hands it to the kernel as it is, under jit too.
It is inference-only: a gradient through it, or any other op on it, raises
PreparedWeightError (use the QArray for those).
"""

from qconvert.ops.conv import conv_general_dilated
from qconvert.ops.dispatch import PATHS, PathDecision, choose_path, record_paths
from qconvert.ops.dot import dot, dot_general, linear
from qconvert.ops.einsum import einsum
from qconvert.ops.kernel_calls import PreparedWeightError, use_kernels
from qconvert.ops.layout import PackedLayoutError, reshape, slice_in_dim, stack, transpose
from qconvert.ops.ragged import grouped_linear, ragged_dot, ragged_dot_general
from qconvert.ops.ste import ste

__all__ = [
    "PATHS",
    "PackedLayoutError",
    "PathDecision",
    "PreparedWeightError",
    "choose_path",
    "conv_general_dilated",
    "dot",
    "dot_general",
    "einsum",
    "grouped_linear",
    "linear",
    "ragged_dot",
    "ragged_dot_general",
    "record_paths",
    "reshape",
    "slice_in_dim",
    "stack",
    "ste",
    "transpose",
    "use_kernels",
]
