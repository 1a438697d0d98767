"""Per-layer verification: each quantized linear through its deployment kernel vs the float layer.

The float reference model runs layer by layer on the evaluation tokens; the input
of every quantized linear is captured there (only the rows of real tokens). The
float layer (reference weight and bias) and the quantized layer (the converted
folder's QArray through the scheme's kernel) then see the same activations.

For a smoothed model the converted linear expects x / s: its norm was divided by
s when s was folded into the linear's columns. s is read back from the folder
as reference_norm_weight / converted_norm_weight per smoothing group, which is
exactly the factor the deployed norm applies (stored dtype rounding included),
so the comparison is against the float layer BEFORE smoothing on the original
activations. Linears outside any group get s = 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from qconvert.errors import InvalidCheckpointError
from qconvert.models import iterate_layers
from qconvert.models.hooks import dense_linear
from qconvert.models.registry import Architecture
from qconvert.verify.metrics import tensor_metrics
from qconvert.verify.kernel_path import QuantizedLinear
from qconvert.verify.results import LayerResult
from qconvert.verify.thresholds import Thresholds, check



def smooth_scales(arch: Architecture, config: Mapping[str, Any], reference: Mapping,
                  converted: Mapping) -> dict[str, np.ndarray]:
    """Per quantized linear fed by a smoothing group: s (float64 [in]) = ref norm weight / converted norm weight.

    Unsmoothed groups give s == 1 exactly; a channel whose norm weight is 0 in
    either folder gets s = 1 (its activation is 0 either way).
    """
    scales: dict[str, np.ndarray] = {}
    for group in arch.smoothing_groups(dict(config)):
        name = f"{group.norm}.weight"
        if name not in reference or name not in converted:
            continue
        ref = np.asarray(reference[name], dtype=np.float64)
        conv = np.asarray(converted[name], dtype=np.float64)
        if ref.shape != conv.shape:
            continue
        ok = (ref != 0) & (conv != 0)
        s = np.where(ok, ref / np.where(ok, conv, 1.0), 1.0)
        if np.all(s == 1.0):
            continue
        for linear in group.linears:
            scales[linear] = s
    return scales


def _capture(name: str, x, valid):
    return x, valid


def captured_inputs(observed: Mapping[str, list], modules: set[str]) -> dict[str, np.ndarray]:
    """{module: float32 [rows, in]} of the real-token rows of each captured input."""
    inputs = {}
    for name, parts in observed.items():
        if name not in modules:
            continue
        rows = []
        for x, valid in parts:
            x = np.asarray(x, dtype=np.float32)
            rows.append(x.reshape(-1, x.shape[-1])[np.asarray(valid).reshape(-1).astype(bool)])
        inputs[name] = np.concatenate(rows)
    return inputs


def float_linear_output(x: np.ndarray, weight, bias) -> np.ndarray:
    """The float layer: x W^T + b in float32 at the highest matmul precision."""
    return np.asarray(dense_linear("", jnp.asarray(x), weight, bias))


def verify_layers(model, reference: Mapping, converted: Mapping, input_ids, attention_mask,
                  modules: Sequence[str], quantized_linear: QuantizedLinear,
                  thresholds: Thresholds, *, scales: Mapping[str, np.ndarray] | None = None,
                  batch_size: int | None = None) -> list[LayerResult]:
    """Compare every module in `modules` (quantized linears) on real activations; one LayerResult each.

    `reference` and `converted` map tensor names to arrays (the converted map
    holds QArrays under "<module>.weight"); `quantized_linear` runs the deployment
    kernel of the scheme.
    """
    wanted = set(modules)
    scales = scales or {}
    results: list[LayerResult] = []

    def observe(name, x, valid):
        return _capture(name, x, valid) if name in wanted else None

    for layer in iterate_layers(model, reference, input_ids, attention_mask, observe=observe,
                                batch_size=batch_size):
        inputs = captured_inputs(layer.observed, wanted)
        for name in sorted(inputs):
            x = inputs[name]
            bias_name = f"{name}.bias"
            ref_bias = reference[bias_name] if bias_name in reference else None
            conv_bias = converted[bias_name] if bias_name in converted else None
            y_float = float_linear_output(x, np.asarray(reference[f"{name}.weight"]),
                                          None if ref_bias is None else np.asarray(ref_bias))
            x_q = x / scales[name].astype(np.float32) if name in scales else x
            y_quant, choice = quantized_linear(name, jnp.asarray(x_q), converted[f"{name}.weight"],
                                               None if conv_bias is None else jnp.asarray(conv_bias))
            metrics = tensor_metrics(y_float, np.asarray(y_quant))
            checks = (check("sqnr_db", name, metrics.sqnr_db, thresholds.min_layer_sqnr_db, "min"),
                      check("cosine", name, metrics.cosine, thresholds.min_layer_cosine, "min"))
            results.append(LayerResult(name, choice, metrics, int(x.shape[0]), checks))
    missing = wanted - {r.name for r in results}
    if missing:
        # A quantized linear the float forward never called: the folder and the
        # reference disagree on the architecture.
        raise InvalidCheckpointError(
            f"no activations reached quantized linear {sorted(missing)[0]} in the reference forward pass; "
            "the folder and the reference disagree on the architecture")
    return results
