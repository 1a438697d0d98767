"""w8a8 (SmoothQuant): compressed-tensors `int-quantized`, int8 weights and int8 activations.

    <m>.weight        int8 [out, in]
    <m>.weight_scale  model float dtype [out, 1]
    <m>.input_scale   float32 [1], static per-tensor activations only
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qconvert.formats import compressed_tensors as ct
from qconvert.formats.layout_base import FLOAT_DTYPES, LayoutFlags, TensorSource
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

FORMAT = "int-quantized"
# vLLM reads the static activation scale as float32 whatever the model dtype.
INPUT_SCALE_DTYPE = np.dtype(np.float32)
# (strategy, dynamic) of the two activation settings: per-token dynamic, or per-tensor static.
DYNAMIC_ACTS = ("token", True)
STATIC_ACTS = ("tensor", False)


class IntQuantizedW8A8(ct.CompressedTensorsInt8):
    """`--scheme w8a8`: int8 codes as they are, per-token dynamic or per-tensor static int8 activations."""

    scheme = "w8a8"
    format = FORMAT
    marker_suffix = ".weight_scale"
    part_suffixes = (".weight", ".weight_scale", ".input_scale")
    takes_input_scale = True

    def kernel_act(self, flags: LayoutFlags) -> str | None:
        return "static" if flags.static_act else "dynamic"

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        specs = [
            TensorSpec(f"{module}.weight", np.int8, (out_features, in_features)),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, 1)),
        ]
        if flags.static_act:
            specs.append(TensorSpec(f"{module}.input_scale", INPUT_SCALE_DTYPE, (1,)))
        return specs

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        ct.check_int8_qarray(module, q, self.scheme)
        tensors = {f"{module}.weight": np.asarray(q.qvalue, dtype=np.int8),
                   f"{module}.weight_scale": np.asarray(q.scale).reshape(q.shape[0], 1)}
        if input_scale is not None:
            tensors[f"{module}.input_scale"] = np.array([input_scale], dtype=INPUT_SCALE_DTYPE)
        return tensors

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        scale = ct.weight_scale(source, module)
        return ct.int8_qarray(source, module, source.tensor(f"{module}.weight", [np.int8], 2), scale)

    def read_input_scale(self, source: TensorSource, module: str) -> float | None:
        """The static activation scale of `module`, or None when it has none (dynamic activations)."""
        name = f"{module}.input_scale"
        if name not in source:
            return None
        return float(source.tensor(name, FLOAT_DTYPES, 1).reshape(-1)[0])

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        if flags.static_act:
            # A static scale comes from calibration, which is what the minmax observer names.
            acts = ct.int_args(8, *STATIC_ACTS, "minmax")
        else:
            acts = ct.int_args(8, *DYNAMIC_ACTS, None)
        return ct.config(FORMAT, acts, ignore)

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        acts = ct.input_activations(qconfig)
        if not ct.activation_is_int8(acts):
            raise ValueError(f"compressed-tensors {FORMAT} config does not quantize input activations to "
                             "symmetric 8-bit int; qconvert's w8a8 layout needs them")
        setting = (acts.get("strategy"), acts.get("dynamic"))
        if setting not in (DYNAMIC_ACTS, STATIC_ACTS):
            raise ValueError(f"compressed-tensors {FORMAT} config has input activations with strategy "
                             f"{setting[0]!r} and dynamic {setting[1]!r}; qconvert reads per-token dynamic "
                             "or per-tensor static ones")
        return LayoutFlags(static_act=setting == STATIC_ACTS)
