"""nf4 (QLoRA NormalFloat): the bitsandbytes 4-bit serialization that transformers loads.

    <m>.weight                    uint8 [ceil(n/2), 1]   earlier element in the high nibble
    <m>.weight.absmax             float32 [ceil(n/64)] (uint8 codes with double quantization)
    <m>.weight.quant_map          float32 [16]           the NF4 levels
    <m>.weight.nested_absmax      float32 [ceil(blocks/256)]   double quantization only
    <m>.weight.nested_quant_map   float32 [256]                double quantization only
    <m>.weight.quant_state.bitsandbytes__nf4  uint8 UTF-8 JSON {quant_type, blocksize, dtype, shape, ...}
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import FLOAT_DTYPES_BY_NAME, Layout, LayoutFlags, TensorSource
from qconvert.formats.packing import (
    NESTED_BLOCK_SIZE,
    dequantize_double_quant,
    double_quantize_absmax,
    signed_dynamic_map,
)
from qconvert.formats.qarray import NF4_BLOCK_SIZE, NF4_LEVELS, QArray
from qconvert.formats.safetensors_io import TensorSpec

QUANT_METHOD = "bitsandbytes"
NF4_STATE_SUFFIX = ".weight.quant_state.bitsandbytes__nf4"


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


def _blob_array(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=np.uint8).copy()


def _skips(key: str, module: str) -> bool:
    try:
        at_start = re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:
        at_start = False
    return at_start or module.endswith(key)


class BitsandbytesNF4(Layout):
    """`--scheme nf4`: 4-bit NormalFloat codes in blocks of 64, optionally double-quantized absmax."""

    scheme = "nf4"
    qarray_kind = "nf4"
    quant_method = QUANT_METHOD
    pip_packages = (QUANT_METHOD, "accelerate")  # transformers' bitsandbytes path raises without accelerate
    marker_suffix = NF4_STATE_SUFFIX
    part_suffixes = (".weight", ".weight.absmax", ".weight.quant_map", ".weight.nested_absmax",
                     ".weight.nested_quant_map", NF4_STATE_SUFFIX)
    takes_double_quant = True
    content_sized_suffixes = (NF4_STATE_SUFFIX,)
    loader_replaces_conv1d = True
    loader_keeps_experts_float = True

    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        # transformers' rule for llm_int8_skip_modules: an entry skips a module when, read as a regular
        # expression, it matches from the start of the name up to a name boundary ("layers.1" skips
        # "layers.1.mlp", not "layers.11"; "mlp.gate" not "mlp.gate_proj"), or when the name ends with it.
        skip = [key for key in qconfig.get("llm_int8_skip_modules") or () if isinstance(key, str)]
        return not any(_skips(key, module) for key in skip)

    def tensor_specs(self, module: str, shape: tuple[int, int], float_dtype, flags: LayoutFlags) -> list[TensorSpec]:
        out_features, in_features = (int(d) for d in shape)
        n = out_features * in_features
        blocks = -(-n // NF4_BLOCK_SIZE)
        specs = [
            TensorSpec(f"{module}.weight", np.uint8, (-(-n // 2), 1)),
            TensorSpec(f"{module}.weight.absmax", np.uint8 if flags.double_quant else np.float32, (blocks,)),
            TensorSpec(f"{module}.weight.quant_map", np.float32, (16,)),
        ]
        if flags.double_quant:
            specs += [
                TensorSpec(f"{module}.weight.nested_absmax", np.float32, (-(-blocks // NESTED_BLOCK_SIZE),)),
                TensorSpec(f"{module}.weight.nested_quant_map", np.float32, (256,)),
            ]
        offset = 0.0 if flags.double_quant else None
        blob = nf4_state_blob(float_dtype, (out_features, in_features), NF4_BLOCK_SIZE, offset)
        specs.append(TensorSpec(f"{module}{NF4_STATE_SUFFIX}", np.uint8, (len(blob),)))
        return specs

    def to_tensors(self, module: str, q: QArray, flags: LayoutFlags,
                   input_scale: float | None = None) -> dict[str, np.ndarray]:
        if q.kind != "nf4":
            raise ValueError(f"{module}: scheme nf4 needs an nf4 QArray, got kind {q.kind}")
        absmax = np.asarray(q.scale, dtype=np.float32).reshape(-1)
        tensors = {f"{module}.weight": np.asarray(q.qvalue, dtype=np.uint8).reshape(-1, 1)}
        if not flags.double_quant:
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

    def read_qarray(self, source: TensorSource, module: str) -> QArray:
        blob_name = module + NF4_STATE_SUFFIX
        where = source.file_of(blob_name)
        try:
            state = json.loads(source.tensor(blob_name, [np.uint8], 1).tobytes().decode("utf-8"))
            shape = tuple(int(d) for d in state["shape"])
            block_size = int(state["blocksize"])
            dtype = np.dtype(FLOAT_DTYPES_BY_NAME[state["dtype"]]).name
            nested = f"{module}.weight.nested_absmax" in source
            offset = float(state["nested_offset"]) if nested else None
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: {module} has an invalid bitsandbytes quant_state ({exc})") from exc
        if state.get("quant_type") != "nf4" or block_size <= 0:
            raise FormatError(f"{where}: {module} quant_state is not nf4 with a positive blocksize")
        n = math.prod(shape)
        blocks = -(-n // block_size)
        packed = source.tensor(f"{module}.weight", [np.uint8], 2)
        quant_map = source.tensor(f"{module}.weight.quant_map", [np.float32], 1)
        if packed.shape != (-(-n // 2), 1) or not np.array_equal(quant_map, NF4_LEVELS):
            raise FormatError(f"{where}: {module} packed weight or quant_map does not fit NF4 {list(shape)}")
        if nested:
            codes = source.tensor(f"{module}.weight.absmax", [np.uint8], 1)
            nested_absmax = source.tensor(f"{module}.weight.nested_absmax", [np.float32], 1)
            nested_map = source.tensor(f"{module}.weight.nested_quant_map", [np.float32], 1)
            if nested_map.shape != (256,) or nested_absmax.shape != (-(-codes.size // NESTED_BLOCK_SIZE),):
                raise FormatError(f"{where}: {module} nested absmax tensors have the wrong shapes")
            absmax = dequantize_double_quant(codes, nested_absmax, offset, nested_map)
        else:
            absmax = source.tensor(f"{module}.weight.absmax", [np.float32], 1)
        if absmax.shape != (blocks,):
            raise FormatError(f"{where}: {module} has {absmax.size} absmax values, NF4 {list(shape)} needs {blocks}")
        return QArray(qvalue=packed.reshape(-1), scale=absmax, kind="nf4", block_size=block_size,
                      shape=shape, dtype=dtype)

    def quantization_config(self, flags: LayoutFlags, ignore: tuple[str, ...], compute_dtype: str) -> dict:
        return {
            "quant_method": QUANT_METHOD, "load_in_4bit": True, "load_in_8bit": False,
            "_load_in_4bit": True, "_load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": bool(flags.double_quant),
            "bnb_4bit_compute_dtype": compute_dtype, "bnb_4bit_quant_storage": "uint8",
            # transformers reads every skip entry as a regular expression from the start of the name:
            # compressed-tensors' `re:` spelling of a pattern entry is dropped.
            "llm_int8_threshold": 6.0, "llm_int8_skip_modules": [key.removeprefix("re:") for key in ignore],
            "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
        }

    def claims(self, qconfig: dict[str, Any]) -> bool:
        return qconfig.get("quant_method") == QUANT_METHOD

    def flags_of(self, qconfig: dict[str, Any]) -> LayoutFlags:
        if not (qconfig.get("load_in_4bit") and qconfig.get("bnb_4bit_quant_type") == "nf4"):
            raise ValueError("bitsandbytes config is not 4-bit nf4")
        storage = qconfig.get("bnb_4bit_quant_storage")
        if storage not in (None, "uint8"):
            raise ValueError(f"bitsandbytes config stores 4-bit codes as {storage!r}; qconvert reads uint8 only")
        return LayoutFlags(double_quant=bool(qconfig.get("bnb_4bit_use_double_quant")))
