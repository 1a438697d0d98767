"""Export layouts: each scheme's tensor names, dtypes and shapes, its quantization_config, and QArray <-> tensors.

Schemes:
  "int8"  compressed-tensors pack-quantized, 8 bits: weight_packed int32 [out, ceil(in/4)],
          weight_scale [out, 1] (model float dtype), weight_shape int64 [2].
  "w8a8"  compressed-tensors int-quantized: weight int8 [out, in], weight_scale [out, 1],
          input_scale float32 [1] for static activations only.
  "nf4"   bitsandbytes 4-bit: weight uint8 [ceil(n/2), 1], weight.absmax, weight.quant_map,
          weight.nested_absmax / weight.nested_quant_map with double quantization,
          weight.quant_state.bitsandbytes__nf4 (UTF-8 JSON bytes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.formats.packing import (
    NESTED_BLOCK_SIZE,
    dequantize_double_quant,
    double_quantize_absmax,
    pack_int8_to_int32,
    signed_dynamic_map,
    unpack_int32_to_int8,
)
from qconvert.formats.qarray import NF4_BLOCK_SIZE, NF4_LEVELS, QArray
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, TensorSpec, open_checkpoint

SCHEMES = ("int8", "w8a8", "nf4")
NF4_STATE_SUFFIX = ".weight.quant_state.bitsandbytes__nf4"
# vLLM reads the static activation scale as float32 whatever the model dtype.
INPUT_SCALE_DTYPE = np.dtype(np.float32)


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def linear_tensor_specs(
    module: str,
    scheme: str,
    shape: tuple[int, int],
    float_dtype,
    *,
    static_act: bool = False,
    double_quant: bool = False,
) -> list[TensorSpec]:
    """The tensors a quantized linear `module` (float weight [out, in]) becomes, in write order.

    `float_dtype` is the dtype of weight_scale (int8/w8a8); it must be the dtype
    of the QArray's scale that qarray_to_tensors will receive.
    """
    _check_scheme(scheme)
    out_features, in_features = (int(d) for d in shape)
    if scheme == "int8":
        return [
            TensorSpec(f"{module}.weight_packed", np.int32, (out_features, -(-in_features // 4))),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, 1)),
            TensorSpec(f"{module}.weight_shape", np.int64, (2,)),
        ]
    if scheme == "w8a8":
        specs = [
            TensorSpec(f"{module}.weight", np.int8, (out_features, in_features)),
            TensorSpec(f"{module}.weight_scale", float_dtype, (out_features, 1)),
        ]
        if static_act:
            specs.append(TensorSpec(f"{module}.input_scale", INPUT_SCALE_DTYPE, (1,)))
        return specs
    n = out_features * in_features
    blocks = -(-n // NF4_BLOCK_SIZE)
    specs = [
        TensorSpec(f"{module}.weight", np.uint8, (-(-n // 2), 1)),
        TensorSpec(f"{module}.weight.absmax", np.uint8 if double_quant else np.float32, (blocks,)),
        TensorSpec(f"{module}.weight.quant_map", np.float32, (16,)),
    ]
    if double_quant:
        specs += [
            TensorSpec(f"{module}.weight.nested_absmax", np.float32, (-(-blocks // NESTED_BLOCK_SIZE),)),
            TensorSpec(f"{module}.weight.nested_quant_map", np.float32, (256,)),
        ]
    offset = 0.0 if double_quant else None
    blob = nf4_state_blob(float_dtype, (out_features, in_features), NF4_BLOCK_SIZE, offset)
    specs.append(TensorSpec(f"{module}{NF4_STATE_SUFFIX}", np.uint8, (len(blob),)))
    return specs


def nf4_state_blob(dtype, shape: tuple[int, ...], block_size: int = NF4_BLOCK_SIZE,
                   nested_offset: float | None = None) -> bytes:
    """The UTF-8 JSON that bitsandbytes keeps in `<m>.weight.quant_state.bitsandbytes__nf4`.

    The nested offset is written in fixed-width scientific notation (10
    significant digits: float32 round-trips exactly) so the blob's length, which
    the shard header must state before the offset is known, does not depend on it.
    """
    fields = {
        "quant_type": "nf4",
        "blocksize": int(block_size),
        "dtype": np.dtype(dtype).name,
        "shape": [int(d) for d in shape],
    }
    if nested_offset is None:
        return json.dumps(fields).encode("utf-8")
    fields.update({"nested_blocksize": NESTED_BLOCK_SIZE, "nested_dtype": "float32", "nested_offset": "@"})
    offset_text = f"{float(np.float32(nested_offset)):.9e}"
    return json.dumps(fields).replace('"@"', offset_text).encode("utf-8")


def qarray_to_tensors(
    module: str,
    q: QArray,
    scheme: str,
    *,
    input_scale: float | None = None,
    double_quant: bool = False,
) -> dict[str, np.ndarray]:
    """The tensors of quantized linear `module`, named and ordered as linear_tensor_specs gives them."""
    _check_scheme(scheme)
    if scheme in ("int8", "w8a8"):
        if q.kind != "int8" or q.ndim != 2:
            raise ValueError(f"{module}: scheme {scheme} needs a 2-D int8 QArray, got kind {q.kind} {q.shape}")
        if q.zero_point is not None:
            raise ValueError(f"{module}: symmetric layouts store no zero point")
        codes = np.asarray(q.qvalue, dtype=np.int8)
        weight_scale = np.asarray(q.scale).reshape(q.shape[0], 1)
        if scheme == "int8":
            return {
                f"{module}.weight_packed": pack_int8_to_int32(codes),
                f"{module}.weight_scale": weight_scale,
                f"{module}.weight_shape": np.array(q.shape, dtype=np.int64),
            }
        tensors = {f"{module}.weight": codes, f"{module}.weight_scale": weight_scale}
        if input_scale is not None:
            tensors[f"{module}.input_scale"] = np.array([input_scale], dtype=INPUT_SCALE_DTYPE)
        return tensors
    if q.kind != "nf4":
        raise ValueError(f"{module}: scheme nf4 needs an nf4 QArray, got kind {q.kind}")
    packed = np.asarray(q.qvalue, dtype=np.uint8).reshape(-1, 1)
    absmax = np.asarray(q.scale, dtype=np.float32).reshape(-1)
    tensors = {f"{module}.weight": packed}
    if not double_quant:
        tensors[f"{module}.weight.absmax"] = absmax
        tensors[f"{module}.weight.quant_map"] = NF4_LEVELS.copy()
        tensors[f"{module}{NF4_STATE_SUFFIX}"] = _blob_array(nf4_state_blob(q.dtype, q.shape, q.block_size))
        return tensors
    codes, nested_absmax, offset = double_quantize_absmax(absmax)
    tensors[f"{module}.weight.absmax"] = codes
    tensors[f"{module}.weight.quant_map"] = NF4_LEVELS.copy()
    tensors[f"{module}.weight.nested_absmax"] = nested_absmax
    tensors[f"{module}.weight.nested_quant_map"] = signed_dynamic_map()
    tensors[f"{module}{NF4_STATE_SUFFIX}"] = _blob_array(nf4_state_blob(q.dtype, q.shape, q.block_size, offset))
    return tensors


def _blob_array(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.uint8).copy()


def _int_args(num_bits: int, strategy: str, dynamic: bool, observer: str | None) -> dict:
    return {
        "num_bits": num_bits, "type": "int", "symmetric": True, "strategy": strategy,
        "group_size": None, "dynamic": dynamic, "actorder": None, "block_structure": None,
        "observer": observer, "observer_kwargs": {},
    }


def quantization_config(
    scheme: str,
    *,
    act: str = "dynamic",
    ignore: tuple[str, ...] = ("lm_head",),
    double_quant: bool = False,
    compute_dtype: str = "bfloat16",
) -> dict:
    """The `quantization_config` entry of config.json for `scheme`, with the exact key set loaders accept.

    `act` ("dynamic" per-token or "static" per-tensor) matters for w8a8 only;
    `ignore` lists the linears left in float; `double_quant` and `compute_dtype` matter for nf4 only.
    """
    _check_scheme(scheme)
    if act not in ("dynamic", "static"):
        raise ValueError(f"act must be 'dynamic' or 'static', got {act!r}")
    if scheme == "nf4":
        return {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "_load_in_4bit": True, "_load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": bool(double_quant),
            "bnb_4bit_compute_dtype": compute_dtype, "bnb_4bit_quant_storage": "uint8",
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": list(ignore),
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
        }
    if scheme == "int8":
        input_activations = None
    elif act == "dynamic":
        input_activations = _int_args(8, "token", True, None)
    else:
        # A static scale comes from calibration, which is what the minmax observer names.
        input_activations = _int_args(8, "tensor", False, "minmax")
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if scheme == "int8" else "int-quantized",
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _int_args(8, "channel", False, "minmax"),
                "input_activations": input_activations,
                "output_activations": None,
            }
        },
    }


def detect_scheme(quantization_config: dict) -> str:
    """The scheme ("int8", "w8a8", "nf4") a quantization_config describes; ValueError if none."""
    if not isinstance(quantization_config, dict):
        raise ValueError("quantization_config is not an object")
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        layout = quantization_config.get("format")
        if layout == "pack-quantized":
            return "int8"
        if layout == "int-quantized":
            return "w8a8"
        raise ValueError(f"compressed-tensors format {layout!r} is not one qconvert reads")
    if method == "bitsandbytes":
        if quantization_config.get("load_in_4bit") and quantization_config.get("bnb_4bit_quant_type") == "nf4":
            return "nf4"
        raise ValueError("bitsandbytes config is not 4-bit nf4")
    raise ValueError(f"quant_method {method!r} is not one qconvert reads")


class QuantizedCheckpoint:
    """A quantized folder read back: its scheme, quantized linears as QArrays, and the float tensors."""

    def __init__(self, folder: Path, config: dict, scheme: str, checkpoint: SafetensorsCheckpoint):
        self.folder = folder
        self.config = config
        self.scheme = scheme
        self.checkpoint = checkpoint
        self.files = checkpoint.files
        self.quantized_modules = _quantized_modules(checkpoint, scheme)
        parts = {name for module in self.quantized_modules for name in self._part_names(module)}
        self.float_names = [name for name in checkpoint.tensor_names if name not in parts]

    def _part_names(self, module: str) -> list[str]:
        if self.scheme == "int8":
            suffixes = [".weight_packed", ".weight_scale", ".weight_shape"]
        elif self.scheme == "w8a8":
            suffixes = [".weight", ".weight_scale", ".input_scale"]
        else:
            suffixes = [".weight", ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax",
                        ".weight.nested_quant_map", NF4_STATE_SUFFIX]
        return [module + s for s in suffixes if module + s in self.checkpoint]

    def get(self, name: str) -> np.ndarray:
        """Any stored tensor, as it is on disk."""
        return self.checkpoint.get(name)

    def _tensor(self, name: str, dtypes, ndim: int) -> np.ndarray:
        if name not in self.checkpoint:
            raise FormatError(f"{self.folder}: tensor {name!r} is missing")
        array = self.checkpoint.get(name)
        if array.dtype not in [np.dtype(d) for d in dtypes] or array.ndim != ndim:
            raise FormatError(
                f"{self.checkpoint.file_of(name)}: tensor {name!r} is {array.dtype}{list(array.shape)}, "
                f"not a {ndim}-D {'/'.join(np.dtype(d).name for d in dtypes)} tensor"
            )
        return array

    def input_scale(self, module: str) -> float | None:
        """The static activation scale of `module` (w8a8 static), or None."""
        name = f"{module}.input_scale"
        if name not in self.checkpoint:
            return None
        return float(self._tensor(name, _FLOAT_DTYPES, 1).reshape(-1)[0])

    def qarray(self, module: str) -> QArray:
        """The QArray of quantized linear `module` (NF4 absmax decoded to float32)."""
        if module not in self.quantized_modules:
            raise KeyError(f"{module!r} is not a quantized linear of {self.folder}")
        if self.scheme == "nf4":
            return self._nf4_qarray(module)
        scale = self._tensor(f"{module}.weight_scale", _FLOAT_DTYPES, 2)
        if self.scheme == "int8":
            shape = tuple(int(d) for d in self._tensor(f"{module}.weight_shape", [np.int64, np.int32], 1))
            packed = self._tensor(f"{module}.weight_packed", [np.int32], 2)
            if len(shape) != 2 or packed.shape != (shape[0], -(-shape[1] // 4)):
                raise FormatError(f"{self.checkpoint.file_of(module + '.weight_packed')}: {module} "
                                  f"weight_packed {list(packed.shape)} does not fit weight_shape {list(shape)}")
            codes = unpack_int32_to_int8(packed, shape[1])
        else:
            codes = self._tensor(f"{module}.weight", [np.int8], 2)
        if scale.shape != (codes.shape[0], 1):
            raise FormatError(f"{self.checkpoint.file_of(module + '.weight_scale')}: {module} weight_scale "
                              f"{list(scale.shape)} does not fit {codes.shape[0]} output channels")
        return QArray(qvalue=codes, scale=scale, kind="int8", shape=codes.shape, dtype=scale.dtype.name)

    def _nf4_qarray(self, module: str) -> QArray:
        blob_name = module + NF4_STATE_SUFFIX
        where = self.checkpoint.file_of(blob_name)
        try:
            state = json.loads(self._tensor(blob_name, [np.uint8], 1).tobytes().decode("utf-8"))
            shape = tuple(int(d) for d in state["shape"])
            block_size = int(state["blocksize"])
            dtype = np.dtype(_NP_FLOAT[state["dtype"]]).name
            nested = f"{module}.weight.nested_absmax" in self.checkpoint
            offset = float(state["nested_offset"]) if nested else None
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: {module} has an invalid bitsandbytes quant_state ({exc})") from exc
        if state.get("quant_type") != "nf4" or block_size <= 0:
            raise FormatError(f"{where}: {module} quant_state is not nf4 with a positive blocksize")
        n = math.prod(shape)
        blocks = -(-n // block_size)
        packed = self._tensor(f"{module}.weight", [np.uint8], 2)
        quant_map = self._tensor(f"{module}.weight.quant_map", [np.float32], 1)
        if packed.shape != (-(-n // 2), 1) or not np.array_equal(quant_map, NF4_LEVELS):
            raise FormatError(f"{where}: {module} packed weight or quant_map does not fit NF4 {list(shape)}")
        if nested:
            codes = self._tensor(f"{module}.weight.absmax", [np.uint8], 1)
            nested_absmax = self._tensor(f"{module}.weight.nested_absmax", [np.float32], 1)
            nested_map = self._tensor(f"{module}.weight.nested_quant_map", [np.float32], 1)
            if nested_map.shape != (256,) or nested_absmax.shape != (-(-codes.size // NESTED_BLOCK_SIZE),):
                raise FormatError(f"{where}: {module} nested absmax tensors have the wrong shapes")
            absmax = dequantize_double_quant(codes, nested_absmax, offset, nested_map)
        else:
            absmax = self._tensor(f"{module}.weight.absmax", [np.float32], 1)
        if absmax.shape != (blocks,):
            raise FormatError(f"{where}: {module} has {absmax.size} absmax values, NF4 {list(shape)} needs {blocks}")
        return QArray(qvalue=packed.reshape(-1), scale=absmax, kind="nf4", block_size=block_size,
                      shape=shape, dtype=dtype)

    def close(self) -> None:
        """Close the checkpoint's open files."""
        self.checkpoint.close()


_NP_FLOAT = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
_MARKER_SUFFIX = {"int8": ".weight_packed", "w8a8": ".weight_scale", "nf4": NF4_STATE_SUFFIX}


def _quantized_modules(checkpoint: SafetensorsCheckpoint, scheme: str) -> list[str]:
    suffix = _MARKER_SUFFIX[scheme]
    return sorted(name[: -len(suffix)] for name in checkpoint.tensor_names if name.endswith(suffix))


def open_quantized(folder) -> QuantizedCheckpoint:
    """Open a folder written in one of the export layouts; the scheme comes from config.json."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"{config_path}: missing; a quantized checkpoint needs its config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{config_path}: invalid ({exc})") from exc
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise FormatError(f"{config_path}: no quantization_config; this is not a quantized checkpoint")
    try:
        scheme = detect_scheme(config["quantization_config"])
    except ValueError as exc:
        raise FormatError(f"{config_path}: {exc}") from exc
    return QuantizedCheckpoint(folder, config, scheme, open_checkpoint(folder))
