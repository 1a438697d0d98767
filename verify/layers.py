"""Per-layer verification: each quantized linear through its deployment kernel vs the float layer.

The float reference model runs layer by layer on the evaluation tokens; the input
of every quantized linear is captured there (only the rows of real tokens). The
float layer (reference weight and bias) and the quantized layer (the converted
folder's QArray through the scheme's kernel) then see the same activations.

For a smoothed model the converted linear expects x / s, and the source of a
linear -> linear group (v_proj, up_proj) gives y / s: verify/smoothing.py
says which s, from the scales qconvert.json records. The comparison is against
the float layer BEFORE smoothing on the original activations. Linears outside
any group get s = 1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from qconvert.cluster import share
from qconvert.cluster.runtime import active
from qconvert.formats.errors import InvalidCheckpointError
from qconvert.calibration.layers import iterate_layers, read_tensors
from qconvert.models.hooks import dense_linear
from qconvert.verify.fidelity import FolderLinear
from qconvert.verify.metrics import TensorMetrics, tensor_metrics
from qconvert.verify.kernel_path import KernelPath
from qconvert.verify.results import KernelChoice, LayerResult
from qconvert.verify.smoothing import SmoothingFactors
from qconvert.verify.thresholds import Check, Thresholds, check


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
                   kernels: KernelPath, thresholds: Thresholds,
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
    y_quant, choice = kernels.linear(name, jnp.asarray(x_q), converted[f"{name}.weight"],
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
                  modules: Sequence[str], kernels: KernelPath,
                  thresholds: Thresholds, *, smoothing: SmoothingFactors | None = None,
                  batch_size: int | None = None, jit: bool = False,
                  folder_linear: FolderLinear | None = None, on_layer=None,
                  ) -> tuple[list[LayerResult], jnp.ndarray]:
    """Compare every module in `modules` (quantized linears) on real activations; one LayerResult each.

    `converted` holds QArrays under "<module>.weight"; `kernels` runs the folder's deployment kernels and
    `folder_linear`, when given, the same layer from the folder's dequantized weights (fidelity). Returns
    the results and the float model's last hidden state (the whole-model check reuses it); `on_layer(i)`
    is called after layer i (progress).
    """
    wanted = set(modules)
    compare = functools.partial(_compare_captured, reference=reference, converted=converted, kernels=kernels,
                                thresholds=thresholds, smoothing=smoothing or SmoothingFactors({}, {}),
                                folder_linear=folder_linear)
    results: list[LayerResult] = []
    final_hidden = None
    # Eager layers: the float ops are cheap, and each kernel compiles once per
    # shape and is reused by the whole-model pass (same token count), where
    # per-layer jit would compile every kernel again inside every layer.
    for layer in iterate_layers(model, reference, input_ids, attention_mask,
                                observe=lambda name, x, valid: (x, valid) if name in wanted else None,
                                batch_size=batch_size, jit=jit):
        final_hidden = layer.hidden
        results += compare(layer.observed, wanted)
        if on_layer is not None:
            on_layer(layer.index)
    head_wanted = wanted - {r.name for r in results}
    if head_wanted and final_hidden is not None:
        # A quantized head (--include lm_head) reads the final norm's output, after the layers.
        results += compare(head_observed(model, reference, final_hidden, attention_mask, head_wanted), head_wanted)
    missing = wanted - {r.name for r in results}
    if missing:  # a quantized linear the float forward never called
        raise InvalidCheckpointError(
            f"no activations reached quantized linear {sorted(missing)[0]} in the reference forward pass; "
            "the folder and the reference disagree on the architecture")
    return results, final_hidden


def _compare_captured(observed: Mapping[str, list], wanted: set[str], **compare_args) -> list[LayerResult]:
    """compare_linear for each wanted module among the captured inputs, in name order.

    In a run of several processes the linears are spread over every device of every process (the largest
    input first, `share.spread`), each compared once where it lands, and every process receives every result.
    """
    inputs = captured_inputs(observed, wanted)
    names = sorted(inputs)
    if not active():
        return [compare_linear(name, inputs[name], **compare_args) for name in names]
    results = share.spread(names, [float(inputs[name].size) for name in names],
                           lambda name, device: compare_linear(name, inputs[name], **compare_args),
                           _encode_result, _decode_result)
    return [results[name] for name in names]


def _encode_result(result: LayerResult) -> tuple[dict, dict]:
    """A LayerResult as share.spread carries it: no arrays, every field as JSON (a float's repr round-trips)."""
    def floats(values: dict) -> dict:
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in values.items()}

    return {}, {"name": result.name, "kernel": result.kernel.as_dict(), "metrics": floats(result.metrics.as_dict()),
                "tokens": int(result.tokens), "checks": [floats(c.as_dict()) for c in result.checks],
                "fidelity": None if result.fidelity is None else floats(result.fidelity.as_dict()),
                "fidelity_checks": [floats(c.as_dict()) for c in result.fidelity_checks]}


def _decode_result(name: str, arrays: dict, meta: dict) -> LayerResult:
    del name, arrays

    def floats(values: dict) -> dict:  # a metric or a check's value as the float it was
        return {k: float(v) if k in ("value", "limit") or k in _METRIC_FIELDS else v for k, v in values.items()}

    return LayerResult(meta["name"], KernelChoice(**meta["kernel"]), TensorMetrics(**floats(meta["metrics"])),
                       meta["tokens"], tuple(Check(**floats(c)) for c in meta["checks"]),
                       None if meta["fidelity"] is None else TensorMetrics(**floats(meta["fidelity"])),
                       tuple(Check(**floats(c)) for c in meta["fidelity_checks"]))


_METRIC_FIELDS = frozenset(TensorMetrics.__dataclass_fields__)
