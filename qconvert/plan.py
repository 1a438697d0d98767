"""The conversion plan: what a conversion will write, which linears are quantized, which tensors stay float, in what order.

Selection: the architecture's block linears, plus modules an --include pattern
names, minus modules an --exclude pattern names. Patterns match module names
(e.g. "model.layers.0.mlp.down_proj"): a glob, or "re:REGEX" matched from the
start of the name (as compressed-tensors reads its `ignore` entries).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any

import numpy as np

from qconvert.consistency import check_weights_match_config
from qconvert.errors import InvalidWeightError, UnsupportedModelError, UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, TensorSpec
from qconvert.models.registry import Architecture
from qconvert.models.weight_only import FAMILY as WEIGHT_ONLY_FAMILY
from qconvert.schemes.base import Scheme
from qconvert.schemes.servers import family_of, scheme_key, tpu_note

FLOAT_WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
# The kind of a tensor written as the source holds it (float or not: int64 position_ids too).
UNCHANGED = "unchanged"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'5GiB', '500MB', '1000000' -> bytes; UsageError for anything else."""
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"cannot read size {text!r}; write e.g. 5GiB, 500MB or a number of bytes")
    number, unit = float(match.group(1)), (match.group(2) or "B").lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return size


def matches(pattern: str, module: str) -> bool:
    """A module name against one --include/--exclude pattern (glob, or re: from the start)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return fnmatch.fnmatchcase(module, pattern)


def check_patterns(include: tuple[str, ...], exclude: tuple[str, ...]) -> None:
    """A `re:` pattern must compile (UsageError, exit 2, naming the flag and the pattern)."""
    for flag, patterns in (("--include", include), ("--exclude", exclude)):
        for pattern in patterns:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as err:
                    raise UsageError(f"{flag} {pattern} is not a valid regular expression ({err}); "
                                     "fix the pattern") from None


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One source tensor (or quantized linear) and the output tensors it becomes."""

    source: str  # the source tensor name; for a quantized linear, its `.weight`
    module: str | None  # set for a quantized linear
    kind: str  # UNCHANGED, or the scheme for a quantized linear
    shape: tuple[int, ...]
    source_dtype: str
    source_bytes: int
    specs: tuple[TensorSpec, ...]

    @property
    def output_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)


@dataclasses.dataclass(frozen=True)
class ConversionPlan:
    """Every output tensor in write order, and the linears left in float (for `ignore`)."""

    tensors: tuple[PlannedTensor, ...]
    ignore: tuple[str, ...]
    dropped: tuple[str, ...]  # source tensors not written (a tied lm_head)
    float_dtype: str  # the dtype of the quantized linears' float weights
    flags: LayoutFlags = LayoutFlags()  # the layout flags every quantized linear is written with
    notes: tuple[str, ...] = ()  # lines for the user about this model's choices (int4's group size)
    server_note: str = ""  # one line when vLLM TPU will not load the folder: what it takes instead

    @property
    def specs(self) -> list[TensorSpec]:
        return [spec for t in self.tensors for spec in t.specs]

    @property
    def quantized_modules(self) -> list[str]:
        return [t.module for t in self.tensors if t.module is not None]


def _linear_candidates(ckpt: SafetensorsCheckpoint) -> list[str]:
    """Modules whose `.weight` is a 2-D float matrix and that are not embedding tables."""
    modules = []
    for name in ckpt.tensor_names:
        module = name[: -len(".weight")]
        if (name.endswith(".weight") and len(ckpt.shape(name)) == 2 and "embed" not in module
                and ckpt.dtype(name).name in FLOAT_WEIGHT_DTYPES):
            modules.append(module)
    return modules


def select_modules(ckpt: SafetensorsCheckpoint, arch: Architecture, include: tuple[str, ...],
                   exclude: tuple[str, ...], dropped: set[str]) -> list[str]:
    """The sorted module names to quantize; a pattern that selects nothing is a UsageError."""
    check_patterns(include, exclude)
    candidates = [m for m in _linear_candidates(ckpt) if f"{m}.weight" not in dropped]
    selected = set(arch.linear_names(ckpt.tensor_names))
    for pattern in include:
        hit = {m for m in candidates if matches(pattern, m)}
        if not hit:
            tied = any(matches(pattern, name[: -len(".weight")]) for name in dropped)
            why = " (lm_head is tied to the input embeddings and stays with them)" if tied else ""
            raise UsageError(f"--include {pattern} matches no linear module{why}; check the pattern")
        selected |= hit
    for pattern in exclude:
        hit = {m for m in selected if matches(pattern, m)}
        if not hit:
            raise UsageError(f"--exclude {pattern} matches no quantized module; check the pattern")
        selected -= hit
    if not selected:
        raise UsageError("no linear module is left to quantize (--exclude "
                         f"{' '.join(exclude)} removes them all); narrow the pattern")
    return sorted(selected)


def _check_linear(ckpt: SafetensorsCheckpoint, module: str) -> tuple[int, int]:
    name = f"{module}.weight"
    shape, dtype = ckpt.shape(name), ckpt.dtype(name).name
    if dtype not in FLOAT_WEIGHT_DTYPES:
        raise InvalidWeightError(f"{name} is {dtype}; quantization takes float32, float16 or bfloat16 weights")
    if len(shape) != 2 or 0 in shape:
        raise InvalidWeightError(
            f"{name} has shape {list(shape)}; a quantized linear needs a non-empty 2-D [out, in] weight"
        )
    bias = f"{module}.bias"
    if bias in ckpt and ckpt.shape(bias) != (shape[0],):
        raise InvalidWeightError(f"{bias} has shape {list(ckpt.shape(bias))}; it must be [{shape[0]}] to fit {name}")
    return shape


def plan_conversion(ckpt: SafetensorsCheckpoint, config: dict[str, Any], arch: Architecture, *,
                    scheme: Scheme, include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                    double_quant: bool = False, static_act: bool = False,
                    group_size: int | str | None = None) -> ConversionPlan:
    """Decide every output tensor, its layout and order (sorted by source name), before any byte is read."""
    if "quantization_config" in config:
        raise UnsupportedModelError("the model is already quantized (config.json has quantization_config); "
                                    "give the float checkpoint")
    # A tied lm_head is the embedding table: loaders re-tie it, so it is not written twice.
    dropped = {"lm_head.weight"} if config.get("tie_word_embeddings") is True and "lm_head.weight" in ckpt else set()
    modules = select_modules(ckpt, arch, tuple(include), tuple(exclude), dropped)
    chosen = set(modules)
    shapes = {name[: -len(".weight")]: _check_linear(ckpt, name[: -len(".weight")]) for name in ckpt.tensor_names
              if name.endswith(".weight") and name[: -len(".weight")] in chosen}
    flags = scheme.layout_flags(act="static" if static_act else "dynamic", double_quant=double_quant,
                                group_size=group_size, shapes=shapes)
    scheme.check_modules(modules, flags)
    tensors = []
    for name in ckpt.tensor_names:
        if name in dropped:
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        shape, dtype = ckpt.shape(name), ckpt.dtype(name)
        if module in modules:
            specs = scheme.layout.tensor_specs(module, shapes[module], dtype, flags)
            tensors.append(PlannedTensor(name, module, scheme.name, shape, dtype.name, ckpt.nbytes(name),
                                         tuple(specs)))
        else:
            spec = TensorSpec(name, dtype, shape)
            tensors.append(PlannedTensor(name, None, UNCHANGED, shape, dtype.name, ckpt.nbytes(name), (spec,)))
    # After the per-linear checks (a weight of the wrong rank or dtype is exit 7), before any byte is read.
    # A weight-only architecture (--any-architecture) has no family to hold the config against.
    if arch.family != WEIGHT_ONLY_FAMILY:
        check_weights_match_config(ckpt, config)
    # Loaders build an lm_head whether or not it is stored (tied), so it is named unless quantized.
    ignore = sorted(set(_linear_candidates(ckpt)) - set(modules) - {"lm_head"})
    if "lm_head" not in modules:
        ignore.insert(0, "lm_head")
    notes = (scheme.group_note(group_size, shapes),)
    return ConversionPlan(tensors=tuple(tensors), ignore=tuple(ignore), dropped=tuple(sorted(dropped)),
                          float_dtype=ckpt.dtype(f"{modules[0]}.weight").name if modules else "float32",
                          flags=flags, notes=tuple(filter(None, notes)),
                          server_note=tpu_note(scheme_key(scheme.name, flags), family_of(config)))


def is_float_array(array: np.ndarray) -> bool:
    """Whether NaN/Inf can occur in the array (a floating dtype, bf16 included)."""
    return np.dtype(array.dtype).name in FLOAT_WEIGHT_DTYPES + ("float64",)
