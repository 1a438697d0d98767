"""The deployment kernels of a folder, as one object verify calls (KernelPath), recording what ran.

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

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qconvert.formats import QArray
from qconvert.kernels import KernelArgumentError, qgrouped_linear, qlinear, resolve_backend
from qconvert.kernels.plan import KernelPlan
from qconvert.kernels.prepared import PreparedWeight, prepare_weight
from qconvert.schemes import scheme_named
from qconvert.verify.results import KernelChoice

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


def run_quantized_linear(x: jax.Array, q: QArray | Prepared, bias, act: str | None, *, backend: str = "auto",
                         input_scale: float | None = None) -> tuple[jax.Array, KernelPlan]:
    """y = x W^T + b through the deployment kernel (activations quantized as `act` says); (y float32, the plan)."""
    x = jnp.asarray(x).astype(deployment_dtype(q.source if isinstance(q, Prepared) else q))
    bias = None if bias is None else jnp.asarray(bias, jnp.float32)
    if isinstance(q, Prepared):
        q = q.weight
    return qlinear(x, q, bias, act=act, input_scale=input_scale, out_dtype=jnp.float32,
                   backend=backend, return_plan=True)


def run_grouped_experts(x: jax.Array, group_sizes, qs: Sequence[QArray], act: str | None, *,
                        backend: str = "auto", input_scales: Sequence[float | None] = ()
                        ) -> tuple[jax.Array, KernelPlan]:
    """Rows of x sorted by expert (group_sizes[e] rows for expert e) through grouped_matmul."""
    x = jnp.asarray(x).astype(deployment_dtype(qs[0]))
    return qgrouped_linear(x, qs, group_sizes, act=act, input_scales=list(input_scales) if act == "static" else (),
                           backend=backend, return_plan=True)


class Prepared:
    """A QArray's prepared kernel operand (prepare_weight), kept beside the QArray it was made from."""

    def __init__(self, source: QArray, weight: PreparedWeight):
        self.source, self.weight = source, weight


# Prepared operands kept at once: enough for a layer's linears, few enough not to hold a model twice.
PREPARED_KEPT = 16


def is_expert(name: str) -> bool:
    """Whether a module is a mixture-of-experts expert linear (run by the grouped kernel)."""
    return ".experts." in name


class KernelPath:
    """A folder's deployment kernels as verify calls them: `linear` for one quantized linear, `grouped` for a
    layer's experts at once. The activation mode is the folder's (its layout and flags: per-token, the
    stored static input_scale, or float); `choices` holds the KernelChoice of each linear, recorded when its
    kernel is planned, which under jit is the tracing call, so what is recorded is what the compiled code runs.
    """

    def __init__(self, quantized, backend: str = "auto"):
        self.quantized, self.backend = quantized, backend
        self.act = quantized.layout.kernel_act(quantized.flags)
        # A scheme whose activations round over a stored scale ahead of its weight-only kernel (nvfp4).
        scheme = scheme_named(quantized.scheme)
        self.rounding = scheme if scheme.calibrated_inputs else None
        self.choices: dict[str, KernelChoice] = {}
        self._input_scales: dict[str, float | None] = {}
        # On a GPU or TPU each weight is laid out for its kernel once (prepare_weight), not on every call.
        self._prepares = resolve_backend(backend) in ("gpu", "tpu")
        self._prepared: dict[str, Prepared] = {}

    def _operand(self, name: str, q: QArray) -> QArray | Prepared:
        """q's prepared operand, made once per weight (the last PREPARED_KEPT named kept); q itself off the
        accelerators, under a trace, or where prepare_weight takes no such weight (qlinear then says why)."""
        if not self._prepares or isinstance(q.qvalue, jax.core.Tracer):
            return q
        kept = self._prepared.get(name)
        if kept is None:  # a folder's weight under one name is one weight for the whole run
            try:
                kept = Prepared(q, prepare_weight(q))
            except KernelArgumentError:
                return q
            self._prepared.pop(name, None)
            while len(self._prepared) >= PREPARED_KEPT:
                self._prepared.pop(next(iter(self._prepared)))
            self._prepared[name] = kept
        return kept

    def input_scale(self, name: str) -> float | None:
        """The folder's static input_scale of linear `name` (None unless activations are static or rounded over
        a stored scale)."""
        if self.act != "static" and self.rounding is None:
            return None
        if name not in self._input_scales:
            self._input_scales[name] = self.quantized.input_scale(name)
        return self._input_scales[name]

    def linear(self, name: str, x, q: QArray, bias) -> tuple[jax.Array, KernelChoice]:
        """(y [M, out] float32, its KernelChoice) of linear `name` on x [M, in]; an expert alone runs as a
        grouped matmul with one group holding every row."""
        if self.rounding is not None:
            x = self.rounding.kernel_activations(jnp.asarray(x).astype(deployment_dtype(q.source if isinstance(
                q, Prepared) else q)), self.input_scale(name))
        if is_expert(name):
            y, plan = run_grouped_experts(x, [x.shape[0]], [q], self.act, backend=self.backend,
                                          input_scales=[self.input_scale(name)])
        else:
            y, plan = run_quantized_linear(x, self._operand(name, q), bias, self.act, backend=self.backend,
                                           input_scale=self.input_scale(name))
        self.choices[name] = kernel_choice(plan)
        return y.astype(jnp.float32), self.choices[name]

    def grouped(self, names: Sequence[str], x, qs: Sequence[QArray], group_sizes) -> jax.Array:
        """The experts `names` (their QArrays `qs`) on the rows of x sorted by expert; float32."""
        if self.rounding is not None:
            scales = jnp.repeat(jnp.asarray([self.input_scale(n) for n in names], jnp.float32),
                                jnp.asarray(group_sizes), total_repeat_length=x.shape[0])
            x = self.rounding.kernel_activations(jnp.asarray(x).astype(deployment_dtype(qs[0])), scales[:, None])
        y, _ = run_grouped_experts(x, group_sizes, qs, self.act, backend=self.backend,
                                   input_scales=[self.input_scale(n) for n in names])
        return y.astype(jnp.float32)
