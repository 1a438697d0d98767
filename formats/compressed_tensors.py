"""The compressed-tensors pieces the int8 and w8a8 layouts share: their base class, the quantization args,
the config, int8 read-back."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from qconvert.formats.errors import FormatError
from qconvert.formats.layout_base import FLOAT_DTYPES, Layout, TensorSource
from qconvert.formats.qarray import QArray

QUANT_METHOD = "compressed-tensors"


def int_args(num_bits: int, strategy: str, dynamic: bool, observer: str | None, group_size: int | None = None) -> dict:
    """A symmetric int QuantizationArgs object, every key written (older vLLM wants exactly these)."""
    return {
        "num_bits": num_bits, "type": "int", "symmetric": True, "strategy": strategy,
        "group_size": group_size, "dynamic": dynamic, "actorder": None, "block_structure": None,
        "observer": observer, "observer_kwargs": {},
    }


def config(fmt: str, input_activations: dict | None, ignore: tuple[str, ...], weights: dict | None = None) -> dict:
    """A compressed-tensors quantization_config: one group over every Linear (8-bit per-channel weights
    unless `weights` gives other QuantizationArgs)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights or int_args(8, "channel", False, "minmax"),
                "input_activations": input_activations,
                "output_activations": None,
            }
        },
    }


def matches_name(name: str, target: str) -> bool:
    """compressed-tensors' name rule for `targets` and `ignore`: `re:REGEX` matched from the start, else the
    exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def loader_quantizes(qconfig: dict[str, Any], module: str) -> bool:
    """Whether compressed-tensors quantizes linear `module`: a config group targets it (the class name
    `Linear`, or its name) and no `ignore` entry matches it."""
    groups = qconfig.get("config_groups")
    targets = [t for g in (groups.values() if isinstance(groups, dict) else ()) if isinstance(g, dict)
               for t in g.get("targets") or () if isinstance(t, str)]
    ignore = [t for t in qconfig.get("ignore") or () if isinstance(t, str)]
    targeted = any(t == "Linear" or matches_name(module, t) for t in targets)
    return targeted and not any(matches_name(module, t) for t in ignore)


def claims(qconfig: dict[str, Any], fmt: str) -> bool:
    """Whether `qconfig` is compressed-tensors in format `fmt`."""
    return qconfig.get("quant_method") == QUANT_METHOD and qconfig.get("format") == fmt


def weight_bits(qconfig: dict[str, Any]) -> set:
    """The num_bits of every config group's weights (unreadable groups give None)."""
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict):
        return {None}
    return {g.get("weights", {}).get("num_bits") if isinstance(g, dict) and isinstance(g.get("weights"), dict)
            else None for g in groups.values()}


def weights_asymmetric(qconfig: dict[str, Any]) -> bool:
    """Whether any config group's weights are asymmetric (`"symmetric": false`: zero points stored)."""
    groups = qconfig.get("config_groups")
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("symmetric") is False
        for g in groups.values())


def _is_int8(args: Any) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 8 and args.get("type", "int") == "int"
            and args.get("symmetric", True) is True)


def input_activations(qconfig: dict[str, Any]) -> dict | None:
    """The input activation args shared by every group, once each group's weights are checked to be
    symmetric 8-bit int per output channel; ValueError naming the setting that does not fit."""
    fmt = qconfig.get("format")
    groups = qconfig.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise ValueError(f"compressed-tensors {fmt} config has no config_groups")
    acts = []
    for name, group in groups.items():
        weights = group.get("weights")
        if not _is_int8(weights) or weights.get("strategy") != "channel":
            shown = {k: weights.get(k) for k in ("num_bits", "type", "symmetric", "strategy")} \
                if isinstance(weights, dict) else weights
            raise ValueError(f"compressed-tensors {fmt} group {name} weights are {shown}; qconvert reads "
                             "symmetric 8-bit int weights per output channel only")
        acts.append(group.get("input_activations"))
    if any(a != acts[0] for a in acts):
        raise ValueError(f"compressed-tensors {fmt} groups quantize input activations differently")
    return acts[0]


def activation_is_int8(acts: Any) -> bool:
    """Symmetric 8-bit int activation args."""
    return _is_int8(acts)


def weight_scale(source: TensorSource, module: str) -> np.ndarray:
    """The stored weight_scale of `module`: a 2-D float tensor (its shape is checked by int8_qarray)."""
    return source.tensor(f"{module}.weight_scale", FLOAT_DTYPES, 2)


def packed_weight(source: TensorSource, module: str, codes_per_word: int
                  ) -> tuple[np.ndarray, tuple[int, int], np.ndarray]:
    """(weight_scale, weight_shape, weight_packed) of a pack-quantized `module`, the packed int32 words checked
    to hold `codes_per_word` codes of each row of weight_shape [out, in]."""
    scale = weight_scale(source, module)
    shape = tuple(int(d) for d in source.tensor(f"{module}.weight_shape", [np.int64, np.int32], 1))
    packed = source.tensor(f"{module}.weight_packed", [np.int32], 2)
    if len(shape) != 2 or packed.shape != (shape[0], -(-shape[1] // codes_per_word)):
        raise FormatError(f"{source.file_of(module + '.weight_packed')}: {module} "
                          f"weight_packed {list(packed.shape)} does not fit weight_shape {list(shape)}")
    return scale, shape, packed


def int8_qarray(source: TensorSource, module: str, codes: np.ndarray, scale: np.ndarray) -> QArray:
    """The int8 QArray of `module` from its codes [out, in] and its weight_scale, which must be [out, 1]."""
    if scale.shape != (codes.shape[0], 1):
        raise FormatError(f"{source.file_of(module + '.weight_scale')}: {module} weight_scale "
                          f"{list(scale.shape)} does not fit {codes.shape[0]} output channels")
    return QArray(qvalue=codes, scale=scale, kind="int8", shape=codes.shape, dtype=scale.dtype.name)


def check_int8_qarray(module: str, q: QArray, scheme: str) -> None:
    """ValueError unless `q` is a 2-D symmetric int8 QArray (what both int8 layouts store)."""
    if not q.kind.int8 or q.ndim != 2:
        raise ValueError(f"{module}: scheme {scheme} needs a 2-D int8 QArray, got kind {q.kind} {q.shape}")
    if q.zero_point is not None:
        raise ValueError(f"{module}: symmetric layouts store no zero point")


class CompressedTensorsInt8(Layout):
    """A compressed-tensors layout of symmetric int8 codes with one weight_scale per output channel;
    subclasses set `format` (the compressed-tensors format name) and the tensors they store."""

    qarray_kind = "int8"
    quant_method = QUANT_METHOD
    format: str

    def claims(self, qconfig: dict[str, Any]) -> bool:
        return claims(qconfig, self.format)

    def loader_quantizes(self, qconfig: dict[str, Any], module: str) -> bool:
        return loader_quantizes(qconfig, module)
