"""The deployment kernel of each scheme, as one function verify calls per quantized linear.

  int8  (W8A16)  int8_weight_matmul: float activations x int8 codes, per-channel scale
  w8a8           quantize_activations (per token, or the static input_scale) then
                 int8_matmul: int32 accumulation, x_scale * w_scale rescale
  nf4            nf4_matmul: codes decoded in-kernel with the NF4 table x block absmax

Activations enter in the model's float dtype (the dtype of the QArray's scale:
bf16 for a bf16 model), as a deployment would feed them. Every call records the
KernelPlan the kernels chose, so the report names the kernel, backend and tiling
that really ran, and says why when a layer fell back to the reference.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from qconvert.formats import QArray
from qconvert.kernels import int8_matmul, int8_weight_matmul, nf4_matmul, quantize_activations
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
                        tiling=tiling, fallback_reason=plan.fallback_reason, interpret=plan.interpret)


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


def make_quantized_linear(quantized, scheme: str, backend: str = "auto"
                          ) -> tuple[QuantizedLinear, dict[str, KernelChoice]]:
    """A QuantizedLinear over a QuantizedCheckpoint, and the dict it fills with each layer's KernelChoice.

    The choice is recorded when the kernel is planned, which under jit is the
    tracing call: what is recorded is what the compiled code runs.
    """
    choices: dict[str, KernelChoice] = {}
    input_scales: dict[str, float | None] = {}

    def quantized_linear(name: str, x, q: QArray, bias):
        if name not in input_scales:
            input_scales[name] = quantized.input_scale(name) if scheme == "w8a8" else None
        y, plan = run_quantized_linear(x, q, bias, scheme, backend=backend, input_scale=input_scales[name])
        if plan.interpret and not isinstance(y, jax.core.Tracer):
            # Interpret mode runs the kernel through host callbacks that dispatch JAX
            # ops themselves; letting the caller dispatch more work while they run
            # can deadlock the CPU client, so an eager call finishes before returning.
            y.block_until_ready()
        choices[name] = kernel_choice(plan)
        return y.astype(jnp.float32), choices[name]

    return quantized_linear, choices
