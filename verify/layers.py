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
activations. Linear -> linear groups (v -> o, up -> down) are read back from the
source linear's rows; the source's own output is multiplied back by s before
it is compared. Linears outside any group get s = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats import QArray
from qconvert.models import iterate_layers, read_tensors
from qconvert.models.hooks import dense_linear
from qconvert.models.family import Family
from qconvert.smooth import channel_map
from qconvert.verify.fidelity import FolderLinear
from qconvert.verify.metrics import tensor_metrics
from qconvert.verify.kernel_path import QuantizedLinear
from qconvert.verify.results import LayerResult
from qconvert.verify.thresholds import Thresholds, check


@dataclasses.dataclass(frozen=True)
class SmoothingFactors:
    """Where the converted model differs from the reference by smoothing, per quantized linear.

    input[m] (float64 [in]): the converted linear m expects x / input[m].
    output[m] (float64 [out]): the converted linear m's output is y / output[m]
    (m is the source of a linear -> linear group, its rows divided by s).
    """

    input: dict[str, np.ndarray]
    output: dict[str, np.ndarray]


def _dequantized(value) -> np.ndarray:
    return np.asarray(value.dequantize(jnp.float32) if isinstance(value, QArray) else value, np.float64)


def smoothing_factors(model: Family, config: Mapping[str, Any], reference: Mapping,
                      converted: Mapping, smoothed_sources: Sequence[str] = ()) -> SmoothingFactors:
    """Read the smoothing scales back from the two folders.

    Norm -> linears groups: s = reference norm gain / converted norm gain (the
    weight, or 1 + weight for Gemma's norms), exact (both are float tensors;
    unsmoothed norms give s == 1). Linear -> linear groups named in `smoothed_sources` (qconvert.json's smoothing
    groups): the source linear's rows were divided by s, so s per row is the
    least-squares ratio of the reference row (with its own input smoothing
    applied) to the dequantized converted row; rounding noise averages out over
    the row, leaving ~0.1% for int8 rows. A source whose scale were corrupted
    would be absorbed here and surface in its consumer's check and the
    whole-model check instead.
    """
    inputs: dict[str, np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}
    for group in model.smoothing_groups():
        name = f"{group.source}.weight"
        if name not in reference or name not in converted:
            continue
        # The gain the norm applies is norm_offset + weight (1 + w for Gemma).
        ref = np.asarray(reference[name], dtype=np.float64) + group.norm_offset
        conv = np.asarray(converted[name], dtype=np.float64) + group.norm_offset
        if ref.shape != conv.shape:
            continue
        ok = (ref != 0) & (conv != 0)
        s = np.where(ok, ref / np.where(ok, conv, 1.0), 1.0)
        if np.all(s == 1.0):
            continue
        for linear in group.linears:
            inputs[linear] = s
    wanted = set(smoothed_sources)
    for group in model.linear_smoothing_groups():
        if group.source not in wanted:
            continue
        ref = np.asarray(reference[f"{group.source}.weight"], np.float64)
        ref = ref * inputs.get(group.source, np.ones(ref.shape[1]))[None, :]
        conv = _dequantized(converted[f"{group.source}.weight"])
        dot = np.sum(ref * conv, axis=1)
        s = np.where(dot > 0, np.sum(ref * ref, axis=1) / np.where(dot > 0, dot, 1.0), 1.0)
        outputs[group.source] = s
        for linear in group.linears:
            in_features = int(np.shape(reference[f"{linear}.weight"])[1])
            inputs[linear] = s[group.source_offset + channel_map(group, in_features)]
    return SmoothingFactors(inputs, outputs)


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


def compare_linear(name: str, x: np.ndarray, reference: Mapping, converted: Mapping,
                   quantized_linear: QuantizedLinear, thresholds: Thresholds,
                   smoothing: SmoothingFactors | None = None,
                   folder_linear: FolderLinear | None = None) -> LayerResult:
    """One linear on inputs x [rows, in]: the float layer against the converted one through its kernel
    (quality) and, with `folder_linear`, the kernel against the folder's own dequantized layer (fidelity)."""
    smoothing = smoothing or SmoothingFactors({}, {})
    bias_name = f"{name}.bias"
    ref_bias = reference[bias_name] if bias_name in reference else None
    conv_bias = converted[bias_name] if bias_name in converted else None
    y_float = float_linear_output(x, np.asarray(reference[f"{name}.weight"]),
                                  None if ref_bias is None else np.asarray(ref_bias))
    x_q = x / smoothing.input[name].astype(np.float32) if name in smoothing.input else x
    y_quant, choice = quantized_linear(name, jnp.asarray(x_q), converted[f"{name}.weight"],
                                       None if conv_bias is None else jnp.asarray(conv_bias))
    y_quant = np.asarray(y_quant, np.float64)
    fidelity, fidelity_checks = None, ()
    if folder_linear is not None:
        # Both sides in the converted model's own terms (smoothed input, unscaled output).
        y_folder = folder_linear(name, np.asarray(x_q, np.float32), converted[f"{name}.weight"],
                                 None if conv_bias is None else np.asarray(conv_bias))
        fidelity = tensor_metrics(y_folder, y_quant)
        fidelity_checks = (check("fidelity_sqnr_db", name, fidelity.sqnr_db,
                                 thresholds.min_fidelity_sqnr_db, "min"),)
    if name in smoothing.output:
        y_quant = y_quant * smoothing.output[name][None, :]
    metrics = tensor_metrics(y_float, y_quant)
    checks = (check("sqnr_db", name, metrics.sqnr_db, thresholds.min_layer_sqnr_db, "min"),
              check("cosine", name, metrics.cosine, thresholds.min_layer_cosine, "min"))
    return LayerResult(name, choice, metrics, int(x.shape[0]), checks, fidelity, fidelity_checks)


def head_observed(model, reference: Mapping, hidden, attention_mask, wanted: set[str]) -> dict[str, list]:
    """{module: [(input, valid)]} of the head's linears in `wanted`, from the float model's last hidden state."""
    observed: dict[str, list] = {}
    mask = jnp.asarray(attention_mask)

    def capture(name, x, weight, bias):
        if name in wanted:
            observed.setdefault(name, []).append((x, mask > 0))
        return jnp.zeros(x.shape[:-1] + (weight.shape[0],), jnp.float32)  # the logits are not needed here

    model.head(read_tensors(reference, model.head_tensor_names()), hidden, mask, capture)
    return observed


def verify_layers(model, reference: Mapping, converted: Mapping, input_ids, attention_mask,
                  modules: Sequence[str], quantized_linear: QuantizedLinear,
                  thresholds: Thresholds, *, smoothing: SmoothingFactors | None = None,
                  batch_size: int | None = None, jit: bool = False,
                  folder_linear: FolderLinear | None = None, on_layer=None,
                  ) -> tuple[list[LayerResult], jnp.ndarray]:
    """Compare every module in `modules` (quantized linears) on real activations; one LayerResult each.

    `reference` and `converted` map tensor names to arrays (the converted map
    holds QArrays under "<module>.weight"); `quantized_linear` runs the deployment
    kernel of the scheme; `folder_linear`, when given, computes the same layer
    from the folder's own dequantized weights, and the kernel's output is also
    compared with it (fidelity). Returns the results and the float model's last hidden
    state (the whole-model check reuses it instead of running the float model again). `on_layer(i)` is
    called after layer i (progress).
    """
    wanted = set(modules)
    smoothing = smoothing or SmoothingFactors({}, {})
    results: list[LayerResult] = []
    final_hidden = None

    def observe(name, x, valid):
        return (x, valid) if name in wanted else None

    # Eager layers: the float ops are cheap, and each kernel compiles once per
    # shape and is reused by the whole-model pass (same token count), where
    # per-layer jit would compile every kernel again inside every layer.
    for layer in iterate_layers(model, reference, input_ids, attention_mask, observe=observe,
                                batch_size=batch_size, jit=jit):
        final_hidden = layer.hidden
        inputs = captured_inputs(layer.observed, wanted)
        for name in sorted(inputs):
            results.append(compare_linear(name, inputs[name], reference, converted, quantized_linear,
                                          thresholds, smoothing, folder_linear))
        if on_layer is not None:
            on_layer(layer.index)
    head_wanted = wanted - {r.name for r in results}
    if head_wanted and final_hidden is not None:
        # A quantized head (--include lm_head) reads the final norm's output, after the layers.
        inputs = captured_inputs(head_observed(model, reference, final_hidden, attention_mask, head_wanted),
                                 head_wanted)
        for name in sorted(inputs):
            results.append(compare_linear(name, inputs[name], reference, converted, quantized_linear,
                                          thresholds, smoothing, folder_linear))
    missing = wanted - {r.name for r in results}
    if missing:
        # A quantized linear the float forward never called: the folder and the
        # reference disagree on the architecture.
        raise InvalidCheckpointError(
            f"no activations reached quantized linear {sorted(missing)[0]} in the reference forward pass; "
            "the folder and the reference disagree on the architecture")
    return results, final_hidden
