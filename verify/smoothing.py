"""Smoothing in a converted folder: the recorded scales checked exactly, and the factors the per-layer checks use.

qconvert.json records each smoothing group's exact float32 scales (format 2):
what the source (a norm's gain, or a linear's rows) was divided by and what
the consumers' input columns were multiplied by. Every smoothed tensor the
folder keeps in float (norms, biases, a linear left float) must be the
reference's with those scales folded in, bit for bit, exactly as the converter
folds them (smooth.apply_fold); one that is not was edited after conversion or
written from other scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats.record import RECORD_NAME, ConversionRecord, RecordedScales, SmoothingRecord
from qconvert.models.family import SmoothingGroup
from qconvert.methods.fold import GroupScales, apply_fold, tensor_folds
from qconvert.verify.params import QuantizedParams


@dataclasses.dataclass(frozen=True)
class SmoothingFactors:
    """Where the converted model differs from the reference by smoothing, per quantized linear.

    input[m] (float64 [in]): the converted linear m expects x / input[m].
    output[m] (float64 [out]): the converted linear m's output is y / output[m]
    (m is the source of a linear -> linear group, its rows divided by s).
    """

    input: dict[str, np.ndarray]
    output: dict[str, np.ndarray]


def check_record_has_scales(record: ConversionRecord) -> None:
    """A smoothed folder whose record predates the scales (format 1) cannot be verified: one clear line."""
    if record.smoothing is not None and record.smoothing.unscaled:
        raise InvalidCheckpointError(
            f"{RECORD_NAME}: records no smoothing scales (format {record.format_version}, written by an older "
            "qconvert); convert the model again to verify it")


def _folds(smoothing: SmoothingRecord):
    """Tensor name -> the TensorFold the converter applied, rebuilt from the recorded scales."""
    return tensor_folds([GroupScales(SmoothingGroup(source, smoothing.groups[source], source_offset=g.source_offset,
                                                    norm_offset=g.norm_offset), 0.0, g.source_scales,
                                     g.input_scales) for source, g in smoothing.scales.items()])


def check_smoothing(smoothing: SmoothingRecord | None, reference: Mapping, converted: QuantizedParams
                    ) -> list[str]:
    """Each float tensor smoothing touched equals the reference's with the recorded scales folded in."""
    if smoothing is None:
        return []
    problems = []
    for name, fold in sorted(_folds(smoothing).items()):
        if name not in reference or name not in converted or converted.is_quantized(name):
            continue  # an absent bias; a quantized weight (its rounding is verify's per-layer business)
        want, got = apply_fold(np.asarray(reference[name]), fold), np.asarray(converted[name])
        if want.shape != got.shape or not np.array_equal(want.view(np.uint8), got.view(np.uint8)):
            differ = int(np.sum(want != got)) if want.shape == got.shape else want.size
            problems.append(f"{name}: {differ} of {want.size} values are not the reference's with the smoothing "
                            f"scales {RECORD_NAME} records folded in")
    return problems


def _source_rows(reference: Mapping, source: str, g: RecordedScales) -> np.ndarray:
    """The source linear's output factor over all its rows (1 outside the group's, for a fused source)."""
    rows = np.ones(np.shape(reference[f"{source}.weight"])[0])
    rows[g.source_offset:g.source_offset + len(g.source_scales)] = g.source_scales
    return rows


def smoothing_factors(smoothing: SmoothingRecord | None, reference: Mapping, converted: Mapping
                      ) -> SmoothingFactors:
    """The per-layer checks' factors. A norm source: the factor its stored gain applies, reference gain /
    converted gain (offset + weight), so the deployed norm's own rounding counts in its consumers' checks.
    A linear source: its recorded scales, on its output rows and its consumers' inputs."""
    inputs: dict[str, np.ndarray] = {}
    outputs: dict[str, np.ndarray] = {}
    for source, g in (smoothing.scales.items() if smoothing is not None else ()):
        name = f"{source}.weight"
        if np.ndim(reference[name]) == 1:
            ref = np.asarray(reference[name], np.float64) + g.norm_offset
            conv = np.asarray(converted[name], np.float64) + g.norm_offset
            ok = (ref != 0) & (conv != 0)
            s = np.where(ok, ref / np.where(ok, conv, 1.0), 1.0)
        else:
            outputs[source] = _source_rows(reference, source, g)
            s = g.input_scales.astype(np.float64)
        for linear in smoothing.groups[source]:
            inputs[linear] = s
    return SmoothingFactors(inputs, outputs)
