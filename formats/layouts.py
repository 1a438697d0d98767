"""The export layouts, one per scheme, collected: find one by scheme or by its quantization_config, open a folder.

    "int8"  compressed-tensors pack-quantized, 8 bits   (layout_int8.PackQuantizedInt8)
    "int4"  compressed-tensors pack-quantized, 4 bits   (layout_int4.PackQuantizedInt4)
    "int4-asym"  the same with zero points              (layout_int4_asym.PackQuantizedInt4Asym)
    "w8a8"  compressed-tensors int-quantized            (layout_w8a8.IntQuantizedW8A8)
    "fp8"   compressed-tensors float-quantized          (layout_fp8.FloatQuantizedFP8)
    "w4a8-fp8"  pack-quantized, 4 bits, fp8 activations (layout_w4a8.PackQuantizedW4A8FP8)
    "nf4"   bitsandbytes 4-bit                          (layout_nf4.BitsandbytesNF4)
    "nvfp4a16"  compressed-tensors nvfp4-pack-quantized (layout_fp4.NVFP4PackQuantized)
    "mxfp4a16"  compressed-tensors mxfp4-pack-quantized (layout_fp4.MXFP4PackQuantized)
    "nvfp4"     the same as nvfp4a16, NVFP4 activations  (layout_fp4.NVFP4W4A4)

Callers ask the Layout object (layout_base.Layout) rather than branch on the
scheme name; the module-level functions below are that, spelled with a scheme.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from qconvert.formats.errors import FormatError, InvalidCheckpointError
from qconvert.formats.jsonfile import CONFIG_NAME, read_config
from qconvert.formats.layout_base import FLOAT_DTYPES, FLOAT_DTYPES_BY_NAME, Layout, LayoutFlags
from qconvert.formats.layout_fp4 import MXFP4PackQuantized, NVFP4PackQuantized, NVFP4W4A4
from qconvert.formats.layout_fp8 import FloatQuantizedFP8
from qconvert.formats.layout_int4 import PackQuantizedInt4
from qconvert.formats.layout_int4_asym import PackQuantizedInt4Asym
from qconvert.formats.layout_int8 import PackQuantizedInt8
from qconvert.formats.layout_w4a8 import PackQuantizedW4A8FP8
from qconvert.formats.layout_nf4 import NF4_BLOCK_SIZE, NF4_STATE_SUFFIX, BitsandbytesNF4, nf4_state_blob
from qconvert.formats.layout_w8a8 import INPUT_SCALE_DTYPE, IntQuantizedW8A8
from qconvert.formats.outside import shown
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, TensorSpec, open_checkpoint

LAYOUTS: tuple[Layout, ...] = (PackQuantizedInt8(), PackQuantizedInt4(), PackQuantizedInt4Asym(), IntQuantizedW8A8(),
                               FloatQuantizedFP8(), BitsandbytesNF4(), PackQuantizedW4A8FP8(), NVFP4PackQuantized(),
                               MXFP4PackQuantized(), NVFP4W4A4())
SCHEMES = tuple(layout.scheme for layout in LAYOUTS)
_BY_SCHEME = {layout.scheme: layout for layout in LAYOUTS}
ACTS = ("dynamic", "static")

__all__ = [
    "ACTS", "FLOAT_DTYPES", "INPUT_SCALE_DTYPE", "LAYOUTS", "NF4_BLOCK_SIZE", "NF4_STATE_SUFFIX", "SCHEMES",
    "Layout", "LayoutFlags", "QuantizedCheckpoint", "layout_for", "layout_for_config",
    "linear_tensor_specs", "nf4_state_blob", "open_quantized", "qarray_to_tensors", "quantization_config",
]


def layout_for(scheme: str) -> Layout:
    """The layout of `scheme`; ValueError for a scheme qconvert does not write."""
    try:
        return _BY_SCHEME[scheme]
    except (KeyError, TypeError):
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}") from None


def layout_for_config(qconfig: Any) -> tuple[Layout, LayoutFlags]:
    """The layout a quantization_config describes and the flags it records: the one parser of
    quantization_config. ValueError saying what does not fit when it describes no layout qconvert reads
    (an unknown method or format, weights that are not 8-bit per channel, activation settings it does not store)."""
    if not isinstance(qconfig, dict):
        raise ValueError("quantization_config is not an object")
    method = qconfig.get("quant_method")
    if method not in {layout.quant_method for layout in LAYOUTS}:
        raise ValueError(f"quant_method {method!r} is not one qconvert reads")
    for layout in LAYOUTS:
        if layout.claims(qconfig):
            return layout, layout.flags_of(qconfig)
    raise ValueError(f"{method} format {qconfig.get('format')!r} is not one qconvert reads")


def linear_tensor_specs(module: str, scheme: str, shape: tuple[int, int], float_dtype, *,
                        static_act: bool = False, double_quant: bool = False,
                        group_size: int | None = None) -> list[TensorSpec]:
    """The tensors a quantized linear `module` (float weight [out, in]) becomes, in write order.

    `float_dtype` is the dtype of weight_scale (int8/w8a8); it must be the dtype
    of the QArray's scale that qarray_to_tensors will receive.
    """
    flags = LayoutFlags(static_act=static_act, double_quant=double_quant, group_size=group_size)
    return layout_for(scheme).tensor_specs(module, shape, float_dtype, flags)


def qarray_to_tensors(module: str, q: QArray, scheme: str, *, input_scale: float | None = None,
                      double_quant: bool = False) -> dict[str, np.ndarray]:
    """The tensors of quantized linear `module`, named and ordered as linear_tensor_specs gives them."""
    layout = layout_for(scheme)
    return layout.to_tensors(module, q, LayoutFlags(double_quant=double_quant), input_scale=input_scale)


def quantization_config(scheme: str, *, act: str = "dynamic", ignore: tuple[str, ...] = ("lm_head",),
                        double_quant: bool = False, compute_dtype: str = "bfloat16",
                        group_size: int | None = None) -> dict:
    """The `quantization_config` entry of config.json for `scheme`, with the exact key set loaders accept.

    `act` ("dynamic" per-token or "static" per-tensor) matters for w8a8 only;
    `ignore` lists the linears left in float; `double_quant` and `compute_dtype` matter for nf4 only.
    """
    layout = layout_for(scheme)
    if act not in ACTS:
        raise ValueError(f"act must be 'dynamic' or 'static', got {act!r}")
    flags = LayoutFlags(static_act=act == "static", double_quant=double_quant, group_size=group_size)
    return layout.quantization_config(flags, tuple(ignore), compute_dtype)


class QuantizedCheckpoint:
    """A quantized folder read back: its layout and flags, quantized linears as QArrays, and the float tensors."""

    def __init__(self, folder: Path, config: dict, layout: Layout | str, checkpoint: SafetensorsCheckpoint,
                 flags: LayoutFlags | None = None):
        self.folder = folder
        self.config = config
        self.layout = layout_for(layout) if isinstance(layout, str) else layout
        self.flags = flags if flags is not None else LayoutFlags()
        self.scheme = self.layout.scheme
        self.checkpoint = checkpoint
        self.files = checkpoint.files
        suffix = self.layout.marker_suffix
        self.quantized_modules = sorted(n[: -len(suffix)] for n in checkpoint.tensor_names if n.endswith(suffix))
        parts = {name for module in self.quantized_modules for name in self.layout.part_names(module, checkpoint)}
        self.float_names = [name for name in checkpoint.tensor_names if name not in parts]

    def __contains__(self, name: object) -> bool:
        return name in self.checkpoint

    def file_of(self, name: str) -> Path:
        return self.checkpoint.file_of(name)

    def get(self, name: str) -> np.ndarray:
        """Any stored tensor, as it is on disk."""
        return self.checkpoint.get(name)

    def tensor(self, name: str, dtypes, ndim: int) -> np.ndarray:
        """A stored tensor; FormatError naming the file unless it is there with one of `dtypes` and `ndim` dims."""
        if name not in self.checkpoint:
            raise FormatError(f"{self.folder}: tensor {name!r} is missing")
        array = self.checkpoint.get(name)
        if array.dtype not in [np.dtype(d) for d in dtypes] or array.ndim != ndim:
            raise FormatError(
                f"{self.checkpoint.file_of(name)}: tensor {name!r} is {array.dtype}{list(array.shape)}, "
                f"not a {ndim}-D {'/'.join(np.dtype(d).name for d in dtypes)} tensor"
            )
        return array

    @property
    def float_dtype(self) -> str:
        """The float dtype the folder stands for, for the layouts whose tensors store none (FP4): config.json's
        torch_dtype (or dtype), bfloat16 where it names none (compressed-tensors decompresses FP4 to bf16)."""
        key = "torch_dtype" if "torch_dtype" in self.config else "dtype"
        declared = self.config.get(key, "bfloat16")
        if not isinstance(declared, str) or declared not in FLOAT_DTYPES_BY_NAME:
            raise FormatError(f"{self.folder / CONFIG_NAME}: {key} is {shown(repr(declared))}, not one of "
                              + ", ".join(FLOAT_DTYPES_BY_NAME))
        return declared

    def input_scale(self, module: str) -> float | None:
        """The static activation scale of `module` (w8a8 static), or None."""
        return self.layout.read_input_scale(self, module) if self.layout.takes_input_scale else None

    def qarray(self, module: str) -> QArray:
        """The QArray of quantized linear `module` (NF4 absmax decoded to float32)."""
        if module not in self.quantized_modules:
            raise KeyError(f"{module!r} is not a quantized linear of {self.folder}")
        return self.layout.read_qarray(self, module)

    def close(self) -> None:
        """Close the checkpoint's open files."""
        self.checkpoint.close()


def open_quantized(folder) -> QuantizedCheckpoint:
    """Open a folder written in one of the export layouts; the layout comes from config.json."""
    folder = Path(folder)
    config_path = folder / CONFIG_NAME
    try:
        config = read_config(folder, missing="a quantized checkpoint needs its config.json",
                             broken="this is not a quantized checkpoint")
    except InvalidCheckpointError as exc:
        raise FormatError(str(exc)) from None
    if "quantization_config" not in config:
        raise FormatError(f"{config_path}: no quantization_config; this is not a quantized checkpoint")
    try:
        layout, flags = layout_for_config(config["quantization_config"])
    except ValueError as exc:
        raise FormatError(f"{config_path}: {exc}") from exc
    return QuantizedCheckpoint(folder, config, layout, open_checkpoint(folder), flags)
