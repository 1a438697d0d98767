"""SmoothQuant as a step: each smoothing group's scales once its linears' statistics are complete, alpha searched
on the group's input rows (`--alpha auto`) or given; its qconvert.json record. The math is methods/smooth.py."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from qconvert.calibration.observer import LayerStats
from qconvert.calibration.statistics import KeptRows, Statistic
from qconvert.formats.errors import UsageError
from qconvert.formats.record import SmoothingRecord
from qconvert.methods.fold import MIN_SCALE, GroupScales
from qconvert.methods.group_scales import GroupScaleStep, recorded_scales, smoothing_groups, written_scales
from qconvert.methods.loop import Results, weight_elements
from qconvert.methods.smooth import group_scales, read_group_weights, search_alpha
from qconvert.models.family import Family, FamilyFacts, SmoothingGroup
from qconvert.options import AlphaSpec, CalibrationOptions

ALPHA_SEARCH = "alpha search"  # the step's progress stage


class SmoothQuant(GroupScaleStep):
    """The step: every group of the model smoothed, in the model's group order."""

    stage = ALPHA_SEARCH

    def __init__(self, model: Family, family: FamilyFacts, options: CalibrationOptions, static: bool):
        self.spec = options.alpha_spec
        super().__init__(checked_groups(model, self.spec))
        self.family, self.options, self.static = family, options, static
        self.shows_progress = self.spec.auto

    def statistics(self) -> list[Statistic]:
        return [KeptRows(frozenset(g.linears[0] for g in self.groups))] if self.spec.auto else []

    def ready(self, group: SmoothingGroup, stats: LayerStats, results: Results) -> bool:
        return all(m in results.act_absmax for m in group.linears)

    def cost(self, group: SmoothingGroup, results: Results) -> float:
        return float(sum(weight_elements(results.params, m) for m in group.linears))

    def choose(self, group: SmoothingGroup, results: Results, stats: LayerStats
               ) -> tuple[GroupScales, dict[float, float] | None]:
        return self._searched(group, results, stats.of(KeptRows))

    def leftover(self, group: SmoothingGroup, results: Results) -> GroupScales:
        """A group calibration left (or, from a statistics file, every group) at the given alpha."""
        return self._smoothing(group, results, None)

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
        spec, family = self.spec, self.family
        mode = "auto" if spec.auto else ("family default" if spec.default is None and not spec.per_group
                                         else "given")
        if mode == "family default" and self.options.alpha is None:
            mode = "family default (a statistics file holds no activation rows to search on)"
        # The relative W8A8 output error of each alpha tried, per group, rounded for reading.
        searched = {source: {f"{a:.2f}": float(f"{e:.4g}") for a, e in tried.items()}
                    for source, tried in self.errors.items()}
        return SmoothingRecord(
            alpha_mode=mode, family_default_alpha=family.default_alpha, min_scale=MIN_SCALE, remedy=family.remedy,
            **recorded_scales(results),
            alpha_search=searched or None)


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
