"""The output tensors: what each planned tensor becomes (read, transformed, checked, quantized into the scheme's
layout), what calibration hands in for them, and how they stream, in plan order, ahead of the shard writer.

`plan` and `planned` below are qconvert.plan's ConversionPlan and PlannedTensor, `scheme` a qconvert.schemes
Scheme: the writer reads them, and imports nothing of the stages above it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from qconvert.formats.errors import InvalidWeightError
from qconvert.formats.layout_base import FLOAT_DTYPES_BY_NAME, LayoutFlags
from qconvert.formats.qarray import QArray
from qconvert.formats.safetensors_io import SafetensorsCheckpoint
from qconvert.formats.safetensors_writer import TensorSpec
from qconvert.write.prefetch import available_cores, run_ahead

# The exponent bits of each float weight dtype: all ones exactly for NaN and Inf.
EXPONENT_BITS = {"float32": (np.uint32, 0x7F800000), "float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80)}


class Progress(Protocol):
    """What the pipeline reports while it streams (the CLI draws a bar from it)."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


class ClipSearches(Protocol):
    """The run's weight-clip searches (qconvert.methods.scale_search.ScaleSearches), as the writer uses them."""

    enabled: bool

    def clip_for(self, module: str, weight: np.ndarray, scheme, flags: LayoutFlags) -> np.ndarray: ...

    def record(self, scheme) -> dict | None: ...


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """What calibration hands the writer for the tensors (all empty for a run that does not calibrate)."""

    # (source name, array) -> the array to quantize or copy (smoothed); None: nothing changed, so a linear
    # streams a block of rows at a time.
    weight_transform: Callable[[str, np.ndarray], np.ndarray] | None = None
    input_scales: Mapping[str, float] = dataclasses.field(default_factory=dict)  # static activations, by linear
    searches: ClipSearches | None = None
    quantized: Mapping[str, QArray] | None = None  # GPTQ's QArrays by module, written as they are
    # Tensors calibration made beside the planned ones, by output name, each written right after the planned
    # tensors of the module that holds it, so in its layer's shard (see `extras_after`).
    extra_tensors: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # quantization_config keys that say what the extra tensors are (the KV cache's `kv_cache_scheme`).
    extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def extras_after(plan, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Planned source tensor -> the extra tensors (by name, sorted) written right after its own output tensors.

    An extra tensor follows the last planned tensor that shares the longest dotted prefix with it
    ("model.layers.0.self_attn.k_scale" the last under "model.layers.0.self_attn."), else the last of all.
    """
    names = sorted(names)
    if not names:
        return {}
    last: dict[str, str] = {}  # every dotted prefix of an output name -> the last planned tensor under it
    for planned in plan.tensors:
        for spec in planned.specs:
            parts = spec.name.split(".")
            last.update((".".join(parts[:k]), planned.source) for k in range(1, len(parts)))
    following: dict[str, tuple[str, ...]] = {}
    for name in names:
        parts = name.split(".")
        prefixes = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
        anchor = next((last[p] for p in prefixes if p in last), plan.tensors[-1].source)
        following[anchor] = following.get(anchor, ()) + (name,)
    return following


def output_specs(plan, calibrated: Calibrated) -> list[TensorSpec]:
    """Every tensor written, in order: the plan's, with calibration's extra tensors placed by `extras_after`."""
    extra = calibrated.extra_tensors
    following = extras_after(plan, extra)
    return [spec for planned in plan.tensors for spec in (
        *planned.specs, *(TensorSpec(n, extra[n].dtype, extra[n].shape) for n in following.get(planned.source, ())))]


def all_finite(array: np.ndarray, chunk_elements: int = 1 << 22) -> bool:
    """Whether a float array has no NaN/Inf, checked in chunks so no full-size mask is allocated.

    float32/16 and bf16 values are NaN or Inf exactly when their exponent bits are all
    ones, so those are checked on the bits in numpy, on the array itself: the same
    answer as isfinite, and no other library is handed the tensor (after a jitted
    check, a 788 MB embedding was seen to stay alive until the thread's next jitted
    call). Other dtypes (float64) go through numpy's isfinite.
    """
    flat = np.ascontiguousarray(array).reshape(-1)
    if np.dtype(flat.dtype).name not in EXPONENT_BITS:
        return all(np.isfinite(flat[i:i + chunk_elements]).all() for i in range(0, flat.size, chunk_elements))
    uint, ones = EXPONENT_BITS[np.dtype(flat.dtype).name]
    bits, ones = flat.view(uint), uint(ones)
    scratch = np.empty(min(bits.size, chunk_elements), uint)
    for i in range(0, bits.size, chunk_elements):
        part = scratch[:min(chunk_elements, bits.size - i)]
        np.bitwise_and(bits[i:i + chunk_elements], ones, out=part)
        if (part == ones).any():
            return False
    return True


def prefetch_limit(plan) -> int:
    """Bytes of source tensors that may be in flight (read or quantized ahead, or being written) at once.

    One largest tensor's worth: peak memory stays near the largest tensor, while
    the linears of a layer (each a fraction of it) overlap their reads and
    quantization with the writing of the ones before.
    """
    return max((t.source_bytes for t in plan.tensors), default=0)


def stream_tensors(ckpt: SafetensorsCheckpoint, plan, scheme, calibrated: Calibrated, progress: Progress | None,
                   workers: int | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of `output_specs`, in its order.

    Reading, transforming, checking and quantizing run on `workers` threads
    (default: one per available core) ahead of the consumer (the shard writer), within
    `prefetch_limit` bytes; the results come in plan order whatever the thread count.
    """
    if progress is not None:
        progress.start(sum(t.source_bytes for t in plan.tensors), len(plan.tensors))
    following = extras_after(plan, calibrated.extra_tensors)
    shared = shared_absmax(ckpt, plan, scheme, calibrated)
    tasks = ((planned.source_bytes, functools.partial(_task, ckpt, planned, scheme, calibrated, plan.flags,
                                                      following.get(planned.source, ()), shared))
             for planned in plan.tensors)
    return run_ahead(tasks, prefetch_limit(plan), on_done=progress.advance if progress is not None else None,
                     workers=workers or available_cores())


def shared_absmax(ckpt: SafetensorsCheckpoint, plan, scheme, calibrated: Calibrated) -> dict[str, float]:
    """The absmax each quantized linear's scale is computed from where the scheme shares it between linears a
    server fuses (NVFP4's global scale: `Scheme.shared_absmax`), read once from the weights as they are written
    (transformed); linears GPTQ rounded got theirs in the GPTQ step, from the weights it rounded."""
    rounded = calibrated.quantized if calibrated.quantized is not None else {}
    by_module = {t.module: t for t in plan.tensors if t.module is not None and t.module not in rounded}

    def absmax(module: str) -> float:
        planned = by_module[module]
        array = ckpt.get(planned.source)
        if calibrated.weight_transform is not None:
            array = _transformed(planned, calibrated.weight_transform(planned.source, array))
        return float(np.abs(np.asarray(array, np.float32)).max(initial=0.0))

    return scheme.shared_absmax(sorted(by_module), absmax)


def _task(ckpt: SafetensorsCheckpoint, planned, scheme, calibrated: Calibrated, flags: LayoutFlags,
          extras: tuple[str, ...], shared: Mapping[str, float] | None = None) -> list[tuple[str, np.ndarray]]:
    """One prefetch task: a planned tensor's output tensors, then the extra tensors that follow it."""
    return (output_tensors(ckpt, planned, scheme, calibrated, flags, shared=shared)
            + [(n, calibrated.extra_tensors[n]) for n in extras])


def output_tensors(ckpt: SafetensorsCheckpoint, planned, scheme, calibrated: Calibrated,
                   flags: LayoutFlags, *, shared: Mapping[str, float] | None = None) -> list[tuple[str, np.ndarray]]:
    """The (name, array) output tensors of one planned tensor: read, transform, check, quantize.

    A linear GPTQ rounded during calibration is taken from `calibrated.quantized` as it is. An
    untransformed 2-D float linear whose scales are not searched is read a block of rows at a
    time (qconvert.schemes.rowwise), so its source is never held whole beside its codes.
    """
    quantized, searches = calibrated.quantized, calibrated.searches
    input_scale = calibrated.input_scales.get(planned.module)
    if quantized is not None and planned.module in quantized:
        tensors = scheme.layout.to_tensors(planned.module, quantized.get(planned.module), flags,
                                           input_scale=input_scale)
        return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]
    if (planned.module is not None and calibrated.weight_transform is None and len(planned.shape) == 2
            and planned.source_dtype in FLOAT_DTYPES_BY_NAME and not (searches is not None and searches.enabled)):
        tensors = quantized_tensors(planned, functools.partial(ckpt.get_rows, planned.source), scheme, flags,
                                    input_scale, shared_absmax=(shared or {}).get(planned.module))
        return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]
    array = ckpt.get(planned.source)
    if calibrated.weight_transform is not None:
        array = _transformed(planned, calibrated.weight_transform(planned.source, array))
    if planned.module is None:
        if np.dtype(array.dtype).name in (*FLOAT_DTYPES_BY_NAME, "float64") and not all_finite(array):
            raise InvalidWeightError(f"{planned.source} has NaN or Inf values; fix the checkpoint")
        return [(planned.source, array)]
    tensors = quantized_tensors(planned, array, scheme, flags, input_scale, searches,
                                shared_absmax=(shared or {}).get(planned.module))
    return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]


def _transformed(planned, array) -> np.ndarray:
    array = np.asarray(array)
    if tuple(array.shape) != planned.shape:
        raise ValueError(f"weight_transform changed the shape of {planned.source} to {list(array.shape)}")
    # The output keeps the source dtype whatever precision the transform computed in.
    return array.astype(np.dtype(planned.source_dtype), copy=False)


def quantized_tensors(planned, weight: np.ndarray | Callable[[int, int], np.ndarray], scheme, flags: LayoutFlags,
                      input_scale: float | None, searches: ClipSearches | None = None, *,
                      shared_absmax: float | None = None) -> dict[str, np.ndarray]:
    """One linear's weight -> its output tensors in the scheme's layout with the plan's `flags` (NaN/Inf refused).

    `weight` is the array, or `read_rows(start, stop)` returning a block of its rows (no scale search).
    `shared_absmax`: the absmax the scheme shares with the linears a server fuses this one with (`shared_absmax`).
    """
    dtype = np.dtype(planned.source_dtype)
    shared = {} if shared_absmax is None else {"shared_absmax": shared_absmax}
    try:
        if callable(weight):
            q = scheme.quantize_rows(weight, planned.shape, dtype, flags, **shared)
        else:
            clip = None
            if searches is not None and searches.enabled:
                clip = searches.clip_for(planned.module, weight, scheme, flags)
            q = scheme.quantize(weight, flags, scale_dtype=dtype, clip=clip, **shared)
    except InvalidWeightError:
        raise InvalidWeightError(f"{planned.source} has NaN or Inf values; fix the checkpoint") from None
    return scheme.layout.to_tensors(planned.module, q, flags, input_scale=input_scale)
