"""The deployment kernel of each quantized linear, as one function verify calls, recording what ran.

The routing from a QArray to its kernel is kernels.qlinear's (the one router):
int8 -> int8_weight_matmul, w8a8 -> quantize_activations + int8_matmul, nf4 ->
nf4_matmul, MoE experts -> grouped_matmul (qgrouped_linear). This module adds
what verify needs around it: activations enter in the model's float dtype (the
dtype of the QArray's scale: bf16 for a bf16 model), as a deployment would
feed them; w8a8 layers take the folder's static input_scale where it has one;
and every call records the KernelPlan that ran, so the report names the
kernel, backend and tiling that really ran (or the XLA contract path, on a CPU
host), and says why when a layer fell back to the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from qconvert.formats import QArray
from qconvert.kernels import qgrouped_linear, qlinear
from qconvert.kernels.plan import KernelPlan
from qconvert.schemes import scheme_named
from qconvert.verify.results import KernelChoice

# (name, x [M, in] float, q, bias or None) -> (y [M, out] float32, KernelChoice)
QuantizedLinear = Callable[[str, jax.Array, QArray, object], tuple[jax.Array, KernelChoice]]


def kernel_choice(plan: KernelPlan) -> KernelChoice:
    """The report's view of a kernels KernelPlan."""
    tiling = None
    if plan.tiling is not None:
        tiling = {"tm": plan.tiling.tm, "tk": plan.tiling.tk, "tn": plan.tiling.tn}
    return KernelChoice(name=plan.name, backend=plan.backend, pallas=plan.is_pallas,
                        tiling=tiling, fallback_reason=plan.fallback_reason, interpret=plan.interpret,
                        tile_table=plan.tile_table)


def deployment_dtype(q: QArray):
    """The activation dtype a deployment feeds this layer: the model's float dtype."""
    return jnp.dtype(q.dtype) if jnp.issubdtype(jnp.dtype(q.dtype), jnp.floating) else jnp.float32


def _act(scheme: str, input_scale) -> str | None:
    return scheme_named(scheme).kernel_act(input_scale)


def run_quantized_linear(x: jax.Array, q: QArray, bias, scheme: str, *, backend: str = "auto",
                         input_scale: float | None = None) -> tuple[jax.Array, KernelPlan]:
    """y = x W^T + b through the scheme's deployment kernel; returns (y float32, the plan that ran)."""
    x = jnp.asarray(x).astype(deployment_dtype(q))
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    return qlinear(x, q, bias, act=_act(scheme, input_scale), input_scale=input_scale, out_dtype=jnp.float32,
                   backend=backend, return_plan=True)


def run_grouped_experts(x: jax.Array, group_sizes, qs: Sequence[QArray], scheme: str, *,
                        backend: str = "auto", input_scales: Sequence[float | None] = ()
                        ) -> tuple[jax.Array, KernelPlan]:
    """Rows of x sorted by expert (group_sizes[e] rows for expert e) through grouped_matmul."""
    x = jnp.asarray(x).astype(deployment_dtype(qs[0]))
    scales = list(input_scales) or [None] * len(qs)
    act = _act(scheme, next((s for s in scales if s is not None), None))
    return qgrouped_linear(x, qs, group_sizes, act=act, input_scales=scales if act == "static" else (),
                           backend=backend, return_plan=True)


def is_expert(name: str) -> bool:
    """Whether a module is a mixture-of-experts expert linear (run by the grouped kernel)."""
    return ".experts." in name


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
            input_scales[name] = quantized.input_scale(name)
        return input_scales[name]

    def quantized_linear(name: str, x, q: QArray, bias):
        if is_expert(name):
            # An expert alone is a grouped matmul with one group holding every row.
            y, plan = run_grouped_experts(x, [x.shape[0]], [q], scheme, backend=backend,
                                          input_scales=[input_scale(name)])
        else:
            y, plan = run_quantized_linear(x, q, bias, scheme, backend=backend, input_scale=input_scale(name))
        choices[name] = kernel_choice(plan)
        return y.astype(jnp.float32), choices[name]

    def quantized_grouped(names: Sequence[str], x, qs: Sequence[QArray], group_sizes):
        y, _ = run_grouped_experts(x, group_sizes, qs, scheme, backend=backend,
                                   input_scales=[input_scale(n) for n in names])
        return y.astype(jnp.float32)

    quantized_linear.grouped = quantized_grouped
    return quantized_linear, choices
