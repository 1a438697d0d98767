"""The deployment kernel of each scheme, as one function verify calls per quantized linear.

  int8  (W8A16)  int8_weight_matmul: float activations x int8 codes, per-channel scale
  w8a8           quantize_activations (per token, or the static input_scale) then
                 int8_matmul: int32 accumulation, x_scale * w_scale rescale
  nf4            nf4_matmul: codes decoded in-kernel with the NF4 table x block absmax
  MoE experts    grouped_matmul over the experts' stacked QArrays (int8 or NF4 rhs); for
                 w8a8 the rows are quantized per token (or with each expert's static
                 input_scale) first and enter as their exact int8 x scale values

Activations enter in the model's float dtype (the dtype of the QArray's scale:
bf16 for a bf16 model), as a deployment would feed them. Every call records the
KernelPlan the kernels chose, so the report names the kernel, backend and tiling
that really ran, and says why when a layer fell back to the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from qconvert.formats import QArray
from qconvert.kernels import (grouped_matmul, int8_matmul, int8_weight_matmul, nf4_matmul,
                              quantize_activations)
from qconvert.kernels.plan import KernelPlan
from qconvert.verify.results import KernelChoice

# (name, x [M, in] float, q, bias or None) -> (y [M, out] float32, KernelChoice)
QuantizedLinear = Callable[[str, jax.Array, QArray, object], tuple[jax.Array, KernelChoice]]


def kernel_choice(plan: KernelPlan) -> KernelChoice:
    """The report's view of a kernels KernelPlan."""
    tiling = None
    if plan.tiling is not None:
        tiling = {"tm": plan.tiling.tm, "tk": plan.tiling.tk, "tn": plan.tiling.tn}
    return KernelChoice(name=plan.name, backend=plan.backend, pallas=not plan.is_reference,
                        tiling=tiling, fallback_reason=plan.fallback_reason, interpret=plan.interpret,
                        tile_table=plan.tile_table)


def deployment_dtype(q: QArray):
    """The activation dtype a deployment feeds this layer: the model's float dtype."""
    return jnp.dtype(q.dtype) if jnp.issubdtype(jnp.dtype(q.dtype), jnp.floating) else jnp.float32


def run_quantized_linear(x: jax.Array, q: QArray, bias, scheme: str, *, backend: str = "auto",
                         input_scale: float | None = None) -> tuple[jax.Array, KernelPlan]:
    """y = x W^T + b through the scheme's deployment kernel; returns (y float32, the plan that ran)."""
    x = jnp.asarray(x).astype(deployment_dtype(q))
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    if scheme == "int8":
        return int8_weight_matmul(x, q.qvalue, q.scale, bias=bias, backend=backend, return_plan=True)
    if scheme == "w8a8":
        x_q, x_scale = quantize_activations(x, input_scale)
        return int8_matmul(x_q, q.qvalue, x_scale, q.scale, bias=bias, backend=backend, return_plan=True)
    if scheme == "nf4":
        return nf4_matmul(x, q.qvalue, q.scale, shape=q.shape, blocksize=q.block_size, bias=bias,
                          backend=backend, return_plan=True)
    raise ValueError(f"no deployment kernel for scheme {scheme!r}")


def is_expert(name: str) -> bool:
    """Whether a module is a mixture-of-experts expert linear (run by the grouped kernel)."""
    return ".experts." in name


def stack_experts(qs: Sequence[QArray]) -> QArray:
    """The experts' [N, K] QArrays as one QArray of logical shape (G, N, K) for grouped_matmul."""
    first = qs[0]
    g, (n, k) = len(qs), first.shape
    if first.kind == "int8":
        return QArray(jnp.stack([jnp.asarray(q.qvalue) for q in qs]),
                      jnp.stack([jnp.asarray(q.scale, jnp.float32).reshape(n, 1) for q in qs]),
                      kind="int8", shape=(g, n, k), dtype=first.dtype)
    # NF4 blocks run over the flattened weight; experts concatenate cleanly when
    # each one holds whole blocks (n * k % 64 == 0, which the kernel needs anyway).
    return QArray(jnp.concatenate([jnp.asarray(q.qvalue).reshape(-1) for q in qs]),
                  jnp.concatenate([jnp.asarray(q.scale, jnp.float32).reshape(-1) for q in qs]),
                  kind="nf4", block_size=first.block_size, shape=(g, n, k), dtype=first.dtype)


def _fake_quant_rows(x: jax.Array, group_sizes: jax.Array, input_scales: Sequence[float | None]) -> jax.Array:
    """W8A8 activations of grouped rows as their exact values x_q * x_scale (float32)."""
    if all(s is None for s in input_scales):
        x_q, x_scale = quantize_activations(x)
        return x_q.astype(jnp.float32) * x_scale[:, None]
    # Static scales differ per expert: each row takes its expert's.
    rows = jnp.arange(x.shape[0])
    expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right"), len(input_scales) - 1)
    row_scale = jnp.asarray([float(s) for s in input_scales], jnp.float32)[expert][:, None]
    return jnp.clip(jnp.round(x.astype(jnp.float32) / row_scale), -127, 127) * row_scale


def run_grouped_experts(x: jax.Array, group_sizes, qs: Sequence[QArray], scheme: str, *,
                        backend: str = "auto", input_scales: Sequence[float | None] = ()
                        ) -> tuple[jax.Array, KernelPlan]:
    """Rows of x sorted by expert (group_sizes[e] rows for expert e) through grouped_matmul."""
    x = jnp.asarray(x).astype(deployment_dtype(qs[0]))
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    if scheme == "w8a8":
        x = _fake_quant_rows(x, group_sizes, list(input_scales) or [None] * len(qs))
    return grouped_matmul(x, stack_experts(qs), group_sizes, transpose_rhs=True, backend=backend,
                          return_plan=True)


def _finish(y, plan: KernelPlan):
    # The kernels already finish an eager interpret-mode call before returning.
    return y.astype(jnp.float32)


def make_quantized_linear(quantized, scheme: str, backend: str = "auto"
                          ) -> tuple[QuantizedLinear, dict[str, KernelChoice]]:
    """A QuantizedLinear over a QuantizedCheckpoint, and the dict it fills with each layer's KernelChoice.

    The choice is recorded when the kernel is planned, which under jit is the
    tracing call: what is recorded is what the compiled code runs.
    """
    choices: dict[str, KernelChoice] = {}
    input_scales: dict[str, float | None] = {}

    def input_scale(name: str) -> float | None:
        if name not in input_scales:
            input_scales[name] = quantized.input_scale(name) if scheme == "w8a8" else None
        return input_scales[name]

    def quantized_linear(name: str, x, q: QArray, bias):
        if is_expert(name):
            # An expert alone is a grouped matmul with one group holding every row.
            y, plan = run_grouped_experts(x, [x.shape[0]], [q], scheme, backend=backend,
                                          input_scales=[input_scale(name)])
        else:
            y, plan = run_quantized_linear(x, q, bias, scheme, backend=backend, input_scale=input_scale(name))
        choices[name] = kernel_choice(plan)
        return _finish(y, plan), choices[name]

    def quantized_grouped(names: Sequence[str], x, qs: Sequence[QArray], group_sizes):
        y, plan = run_grouped_experts(x, group_sizes, qs, scheme, backend=backend,
                                      input_scales=[input_scale(n) for n in names])
        return _finish(y, plan)

    quantized_linear.grouped = quantized_grouped
    return quantized_linear, choices
