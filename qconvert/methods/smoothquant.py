"""SmoothQuant as a step: each smoothing group's scales once its linears' statistics are complete, alpha searched
on the group's input rows (`--alpha auto`) or given; its qconvert.json record. The math is methods/smooth.py."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from qconvert.calibration.observer import LayerStats
from qconvert.cluster.share import spread
from qconvert.formats.errors import UsageError
from qconvert.formats.record import RecordedScales, SmoothingRecord
from qconvert.methods.loop import Results, weight_elements
from qconvert.methods.smooth import (MIN_SCALE, GroupScales, group_scales, read_group_weights, search_alpha,
                                     stored_gain_scales)
from qconvert.models.family import Family, FamilyFacts, SmoothingGroup
from qconvert.options import AlphaSpec, CalibrationOptions
from qconvert.progress import Reporter

ALPHA_SEARCH = "alpha search"  # the step's progress stage


class SmoothQuant:
    """The step: every group of the model smoothed, in the model's group order."""

    rewrites = False

    def __init__(self, model: Family, family: FamilyFacts, options: CalibrationOptions, static: bool):
        self.spec = options.alpha_spec
        self.groups = checked_groups(model, self.spec)
        self.family, self.options, self.static = family, options, static
        self._pending = list(self.groups)
        self._progress: Reporter | None = None
        self.errors: dict[str, dict[float, float]] = {}  # group source -> each alpha tried -> its error

    def kept_rows(self) -> set[str]:
        return {g.linears[0] for g in self.groups} if self.spec.auto else set()

    def hessians(self) -> frozenset[str]:
        return frozenset()

    def start(self, progress: Reporter) -> None:
        self._progress = progress
        if self.spec.auto and self.groups:
            progress.step(ALPHA_SEARCH, 0, len(self.groups), "groups")

    def layer(self, stats: LayerStats, results: Results) -> None:
        ready = {g.source: g for g in self._pending if all(m in results.act_absmax for m in g.linears)}
        # The groups' searches spread over the devices (every process's in a run of several).
        found = spread(list(ready), [float(sum(weight_elements(results.params, m) for m in g.linears))
                                     for g in ready.values()],
                       lambda source, device: self._searched(ready[source], results, stats.input_samples),
                       _encoded_smoothing,
                       lambda source, arrays, meta: _decoded_smoothing(ready[source], arrays, meta))
        for source, group in ready.items():
            self._pending.remove(group)
            results.smoothing[source], errors = found[source]
            if errors is not None:
                self.errors[source] = errors
            if self.spec.auto:
                self._progress.step(ALPHA_SEARCH, len(results.smoothing), len(self.groups), "groups")
        results.unsmoothed = {m for g in self._pending for m in (*g.linears, g.source)}

    def finish(self, results: Results) -> None:
        """The groups calibration left (or, from a statistics file, every group) at the given alpha."""
        for group in self._pending:
            results.smoothing[group.source] = self._smoothing(group, results, None)
        self._pending = []
        results.unsmoothed = set()
        results.smoothing = {g.source: results.smoothing[g.source] for g in self.groups}
        results.smoothing_record = self.record(results)

    def replacement(self, index: int) -> None:
        return None

    def _searched(self, group: SmoothingGroup, results: Results, samples: Mapping[str, np.ndarray] | None
                  ) -> tuple[GroupScales, dict[float, float] | None]:
        """`_smoothing` of one group, and each alpha's error where it searched (None where not)."""
        scales = self._smoothing(group, results, samples)
        return scales, self.errors.pop(group.source, None)

    def _smoothing(self, group: SmoothingGroup, results: Results, samples: Mapping[str, np.ndarray] | None
                   ) -> GroupScales:
        """A group's smoothing: alpha searched on its input rows (each alpha's error kept for the record) or
        given; as the folder carries it (`written_scales`), which is what the clip search and GPTQ then round."""
        weights = read_group_weights(results.params, group)
        absmax = group_act_absmax(results.act_absmax, group)
        if samples is not None and self.spec.auto:
            scales, self.errors[group.source] = search_alpha(group, absmax, weights, samples[group.linears[0]],
                                                             static=self.static)
        else:
            scales = group_scales(group, absmax, weights, self.spec.alpha_for(group.source, self.family.default_alpha))
        return written_scales(scales, results.params)

    def record(self, results: Results) -> SmoothingRecord:
        """qconvert.json's `smoothing`: how alpha was chosen, each group's alpha, and the exact scales folded."""
        spec, family, scales = self.spec, self.family, list(results.smoothing.values())
        mode = "auto" if spec.auto else ("family default" if spec.default is None and not spec.per_group
                                         else "given")
        if mode == "family default" and self.options.alpha is None:
            mode = "family default (a statistics file holds no activation rows to search on)"
        # The relative W8A8 output error of each alpha tried, per group, rounded for reading.
        searched = {source: {f"{a:.2f}": float(f"{e:.4g}") for a, e in tried.items()}
                    for source, tried in self.errors.items()}
        return SmoothingRecord(
            alpha_mode=mode, family_default_alpha=family.default_alpha, min_scale=MIN_SCALE, remedy=family.remedy,
            alpha={g.group.source: g.alpha for g in scales},
            groups={g.group.source: tuple(g.group.linears) for g in scales},
            scales={g.group.source: RecordedScales(g.source_scales, g.input_scales, g.group.source_offset,
                                                   g.group.norm_offset) for g in scales},
            alpha_search=searched or None)


def _encoded_smoothing(found: tuple[GroupScales, dict[float, float] | None]) -> tuple[dict, dict]:
    scales, errors = found
    return ({"source_scales": scales.source_scales, "input_scales": scales.input_scales},
            {"alpha": scales.alpha, "errors": None if errors is None else [[a, e] for a, e in errors.items()]})


def _decoded_smoothing(group: SmoothingGroup, arrays: dict, meta: dict
                       ) -> tuple[GroupScales, dict[float, float] | None]:
    errors = None if meta["errors"] is None else {float(a): float(e) for a, e in meta["errors"]}
    return GroupScales(group, meta["alpha"], arrays["source_scales"], arrays["input_scales"]), errors


def smoothing_groups(model: Family) -> list[SmoothingGroup]:
    """The family's norm -> linears groups, then its linear -> linear groups (the o/down remedy)."""
    return model.smoothing_groups() + model.linear_smoothing_groups()


def checked_groups(model: Family, spec: AlphaSpec) -> list[SmoothingGroup]:
    """The model's smoothing groups; UsageError when --alpha names a group it does not have."""
    groups = smoothing_groups(model)
    unknown = spec.unmatched_keys([g.source for g in groups])
    if unknown:
        raise UsageError(f"--alpha names {', '.join(unknown)}, which matches no smoothing group of "
                         f"this model; groups are e.g. {groups[0].source if groups else '(none)'}")
    return groups


def group_act_absmax(act_absmax: Mapping[str, np.ndarray], group: SmoothingGroup) -> np.ndarray:
    """max|x| per channel of a group's input: element-wise max over its linears' statistics.

    The linears see the same input, except experts, which each see only the
    tokens routed to them; the max over all of them covers every token.
    """
    present = [act_absmax[m] for m in group.linears if m in act_absmax]
    if not present:
        raise UsageError(f"no activation statistics for {group.linears[0]}; calibrate this model again")
    return to_bfloat16(np.max(np.stack(present), axis=0))


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32.

    The smoothing scales are shaped by these maxima. Calibration activations
    differ in their last bits between backends (GPU and CPU sum in different
    orders); maxima rounded to 8 significant bits agree unless one lies within
    that noise of a bfloat16 rounding boundary, so the smoothed weights do too.
    """
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def written_scales(scales: GroupScales, params: Mapping) -> GroupScales:
    """A group's scales as the folder carries them: a gain stored as an offset from 1 (Gemma) is rounded near
    -1, so its consumers fold what the stored gain really divides by (smooth.stored_gain_scales)."""
    if not scales.group.norm_offset:
        return scales
    return stored_gain_scales(scales, np.asarray(params[f"{scales.group.source}.weight"]))
