"""fp8 (FP8_DYNAMIC): compressed-tensors `float-quantized`, E4M3 weights per output channel, dynamic activations.

    <m>.weight        F8_E4M3 (float8_e4m3fn) [out, in]
    <m>.weight_scale  model float dtype [out, 1]

No zero point and no input_scale: the server quantizes activations per token at run time.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import Layout, LayoutFlags, TensorSource
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

FORMAT = "float-quantized"
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
# (strategy, dynamic) of the weights and of the input activations, as the FP8_DYNAMIC preset sets them.
WEIGHT_SETTING = ("channel", False)
ACT_SETTING = ("token", True)


def float_args(strategy: str, dynamic: bool, observer: str | None) -> dict:
    """A symmetric 8-bit float QuantizationArgs object, with the key set the int layouts write."""
    return {**ct.int_args(8, strategy, dynamic, observer), "type": "float"}


def _is_fp8(args: Any, setting: tuple[str, bool]) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 8 and args.get("type") == "float"
            and args.get("symmetric", True) is True and (args.get("strategy"), args.get("dynamic")) == setting)


class FloatQuantizedFP8(Layout):
    """`--scheme fp8`: float8_e4m3fn weights with one scale per output channel, per-token dynamic fp8 activations."""

    scheme = "fp8"
    qarray_kind = "fp8"
    quant_method = ct.QUANT_METHOD
    marker_suffix = ".weight_scale"
    part_suffixes = (".weight", ".weight_scale")

    def kernel_act(self, flags: LayoutFlags) -> str | None:
        return "dynamic"

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        return [
            TensorSpec(f"{module}.weight", FP8_DTYPE, (out_features, in_features)),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, 1)),
        ]

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        if q.kind != self.qarray_kind or q.ndim != 2 or q.zero_point is not None:
            raise ValueError(f"{module}: scheme fp8 needs a 2-D symmetric fp8 QArray, got kind {q.kind} {q.shape}")
        return {f"{module}.weight": np.asarray(q.qvalue, dtype=FP8_DTYPE),
                f"{module}.weight_scale": np.asarray(q.scale).reshape(q.shape[0], 1)}

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        scale = ct.weight_scale(source, module)
        codes = source.tensor(f"{module}.weight", [FP8_DTYPE], 2)
        if scale.shape != (codes.shape[0], 1):
            raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale "
                              f"{list(scale.shape)} does not fit {codes.shape[0]} output channels")
        return QArray(qvalue=codes, scale=scale, kind=self.qarray_kind, shape=codes.shape, dtype=scale.dtype.name)

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        # The observer names how the weight scales were found (min/max), as llm-compressor records it;
        # dynamic activations have none.
        return ct.config(FORMAT, float_args(*ACT_SETTING, None), ignore,
                         weights=float_args(*WEIGHT_SETTING, "minmax"))

    def claims(self, qconfig: dict[str, Any]) -> bool:
        return ct.claims(qconfig, FORMAT)

    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        return ct.loader_quantizes(qconfig, module)

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        groups = qconfig.get("config_groups")
        if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
            raise ValueError(f"compressed-tensors {FORMAT} config has no config_groups")
        for name, group in groups.items():
            weights, acts = group.get("weights"), group.get("input_activations")
            if not _is_fp8(weights, WEIGHT_SETTING):
                shown = {k: weights.get(k) for k in ("num_bits", "type", "strategy", "dynamic")} \
                    if isinstance(weights, dict) else weights
                raise ValueError(f"compressed-tensors {FORMAT} group {name} weights are {shown}; qconvert reads "
                                 "symmetric fp8 weights per output channel only")
            if not _is_fp8(acts, ACT_SETTING):
                shown = {k: acts.get(k) for k in ("num_bits", "type", "strategy", "dynamic")} \
                    if isinstance(acts, dict) else acts
                raise ValueError(f"compressed-tensors {FORMAT} group {name} input activations are {shown}; "
                                 "qconvert's fp8 layout quantizes them to fp8 per token at run time")
        return LayoutFlags()
