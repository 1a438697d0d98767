"""What every on-disk layout of a quantized linear answers, and the flags a quantization_config records.

A layout is one scheme's way of storing a quantized linear: its tensor names,
dtypes and shapes, how a QArray becomes those tensors and comes back, the
`quantization_config` loaders read, and how to recognise that config again.
The five layouts live in layout_int8.py, layout_int4.py, layout_w8a8.py, layout_fp8.py and layout_nf4.py;
layouts.py collects them.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import TensorSpec

# The float dtypes a scale or a kept tensor may have, by the names configs and quant states use.
FLOAT_DTYPES_BY_NAME = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FLOAT_DTYPES = list(FLOAT_DTYPES_BY_NAME.values())


@dataclasses.dataclass(frozen=True)
class LayoutFlags:
    """The choices beyond the scheme that a quantization_config records and the tensors follow."""

    static_act: bool = False  # w8a8: one static per-tensor input_scale per linear
    double_quant: bool = False  # nf4: the block absmax quantized again
    group_size: int | None = None  # int4: input columns per weight_scale (None: one scale per output channel)


class TensorSource(Protocol):
    """Where a layout reads a module's stored tensors from (a QuantizedCheckpoint)."""

    def __contains__(self, name: object) -> bool: ...

    def tensor(self, name: str, dtypes, ndim: int) -> np.ndarray:
        """The stored tensor, FormatError unless it is present with one of `dtypes` and `ndim` dimensions."""

    def file_of(self, name: str) -> Path: ...

    @property
    def float_dtype(self) -> str:
        """The float dtype's name the folder stands for (config.json's), for layouts whose tensors store none."""


class Layout(abc.ABC):
    """One on-disk scheme. Subclasses set the class attributes and implement the six methods."""

    scheme: str  # the --scheme name
    qarray_kind: str  # the QArray kind it stores ("int8", "int4", "fp8" or "nf4")
    quant_method: str  # quantization_config["quant_method"]
    # What `pip install` needs beside transformers to load the layout (default: the quant_method's package).
    pip_packages: tuple[str, ...] = ()
    marker_suffix: str  # the one tensor (module + suffix) every quantized linear of this layout has
    part_suffixes: tuple[str, ...]  # every tensor a quantized linear may have, module + suffix
    takes_input_scale: bool = False  # a static activation scale may be stored per linear
    # Tensors whose length follows their content (a JSON blob), so a planned shape is only an estimate.
    content_sized_suffixes: tuple[str, ...] = ()
    takes_double_quant: bool = False
    # What the loader (transformers' integration of the layout's library) does beyond its config's
    # targets: it also swaps GPT-2-style Conv1D modules for quantized linears (bitsandbytes), and it leaves
    # the experts float, which transformers 5.x holds fused in one 3-D parameter (bitsandbytes 4-bit).
    loader_replaces_conv1d: bool = False
    loader_keeps_experts_float: bool = False
    # The config transformers' from_pretrained needs to read the layout right ("" for none): a Python expression
    # of the transformers namespace, passed as quantization_config=.
    transformers_quantization_config: str = ""
    # The dtype transformers must load the model in to read the layout ("" for the checkpoint's own): a torch
    # dtype's name, passed as dtype=.
    transformers_dtype: str = ""

    def kernel_act(self, flags: LayoutFlags) -> str | None:
        """How the deployment kernels quantize this layout's activations: "dynamic" (per token), "static"
        (the stored per-tensor input_scale), or None (they stay float: weight-only)."""
        del flags
        return None

    @abc.abstractmethod
    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        """Whether the loader reading `qconfig` replaces linear `module` by a quantized one: the config
        targets it and its ignore (or skip) list does not name it, by the loader's own matching rule."""

    @abc.abstractmethod
    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype,
                     flags: LayoutFlags) -> list[TensorSpec]:
        """The tensors quantized linear `module` (float weight [out, in]) becomes, in write order.

        `float_dtype` is the dtype of the QArray's scale that to_tensors will receive.
        """

    @abc.abstractmethod
    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        """The tensors of quantized linear `module`, named and ordered as tensor_specs gives them."""

    @abc.abstractmethod
    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        """The QArray stored for `module` (FormatError naming the file when the tensors do not fit)."""

    @abc.abstractmethod
    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        """config.json's `quantization_config`, with the exact key set and order loaders accept."""

    @abc.abstractmethod
    def claims(self, qconfig: dict[str, Any]) -> bool:
        """Whether `qconfig` names this layout (its quant_method and format), whatever its settings."""

    @abc.abstractmethod
    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        """The flags a config this layout claims records; ValueError when its settings are not ones it stores."""

    def part_names(self, module: str, present) -> list[str]:
        """The tensors of quantized linear `module` that `present` (a container of names) holds."""
        return [module + s for s in self.part_suffixes if module + s in present]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scheme}>"
