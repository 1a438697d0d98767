"""The group-scale step SmoothQuant and AWQ share: each smoothing group's scales chosen once its layer is ready.

A subclass says when a group is ready (`ready`), what choosing its scales costs (`cost`), how it chooses them
(`choose`: the scales, or None to leave the group unsmoothed, and each candidate's error for the record),
what a group calibration never reached gets (`leftover`), and its qconvert.json record (`record`). The base
spreads the ready groups over the devices (every process's, in a run of several: each group chosen once, by
its owner, and shared, so every process folds the same bytes whatever the mesh), keeps `Results.smoothing`
in the model's group order and tells the steps after it which modules still wait for a group
(`Results.unsmoothed`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from qconvert.calibration.observer import LayerStats
from qconvert.cluster.share import spread
from qconvert.formats.record import SmoothingRecord
from qconvert.methods.fold import GroupScales, stored_gain_scales
from qconvert.methods.loop import Results, Step
from qconvert.models.family import Family, SmoothingGroup

Chosen = tuple[GroupScales | None, dict | None]  # a group's scales (None: unsmoothed) and its candidates' errors


def smoothing_groups(model: Family) -> list[SmoothingGroup]:
    """The family's norm -> linears groups, then its linear -> linear groups (the o/down remedy)."""
    return model.smoothing_groups() + model.linear_smoothing_groups()


def written_scales(scales: GroupScales, params: Mapping) -> GroupScales:
    """A group's scales as the folder carries them: a gain stored as an offset from 1 (Gemma) is rounded near
    -1, so its consumers fold what the stored gain really divides by (fold.stored_gain_scales)."""
    if not scales.group.norm_offset:
        return scales
    return stored_gain_scales(scales, np.asarray(params[f"{scales.group.source}.weight"]))


class GroupScaleStep(Step):
    """Per smoothing group, scales chosen as soon as the group is ready, spread over the devices."""

    unit = "groups"
    shows_progress = True   # whether the stage is shown (a given alpha searches nothing)

    def __init__(self, groups: list[SmoothingGroup]):
        self.groups = groups
        self._pending = list(groups)
        self.errors: dict[str, dict] = {}  # group source -> each candidate's error

    def stage_total(self) -> int:
        return len(self.groups) if self.shows_progress else 0

    def ready(self, group: SmoothingGroup, stats: LayerStats, results: Results) -> bool:
        """Whether the group's statistics are complete."""
        raise NotImplementedError

    def cost(self, group: SmoothingGroup, results: Results) -> float:
        """The group's share of the work, to spread the groups over the devices."""
        raise NotImplementedError

    def choose(self, group: SmoothingGroup, results: Results, stats: LayerStats) -> Chosen:
        """The group's scales as the folder carries them, and each candidate's error (None: none searched)."""
        raise NotImplementedError

    def leftover(self, group: SmoothingGroup, results: Results) -> GroupScales | None:
        """The scales of a group calibration never reached (or, from a statistics file, every group)."""
        return None

    def record(self, results: Results) -> SmoothingRecord:
        """qconvert.json's `smoothing`."""
        raise NotImplementedError

    def layer(self, stats: LayerStats, results: Results) -> None:
        ready = {g.source: g for g in self._pending if self.ready(g, stats, results)}
        if ready:
            found = spread(list(ready), [self.cost(g, results) for g in ready.values()],
                           lambda source, device: self.choose(ready[source], results, stats), _encoded,
                           lambda source, arrays, meta: _decoded(ready[source], arrays, meta))
            for source, group in ready.items():
                self._pending.remove(group)
                scales, errors = found[source]
                if scales is not None:
                    results.smoothing[source] = scales
                if errors is not None:
                    self.errors[source] = errors
                if self.shows_progress:
                    self.advance(len(self.groups) - len(self._pending))
        results.unsmoothed = {m for g in self._pending for m in (*g.linears, g.source)}

    def finish(self, results: Results) -> None:
        for group in self._pending:
            scales = self.leftover(group, results)
            if scales is not None:
                results.smoothing[group.source] = scales
        self._pending = []
        results.unsmoothed = set()
        results.smoothing = {g.source: results.smoothing[g.source] for g in self.groups
                             if g.source in results.smoothing}
        results.smoothing_record = self.record(results)


def _encoded(found: Chosen) -> tuple[dict, dict]:
    scales, errors = found
    if scales is None:
        return {}, {"alpha": None}
    return ({"source_scales": scales.source_scales, "input_scales": scales.input_scales},
            {"alpha": scales.alpha, "errors": None if errors is None else [[k, e] for k, e in errors.items()]})


def _decoded(group: SmoothingGroup, arrays: dict, meta: dict) -> Chosen:
    if meta["alpha"] is None:
        return None, None
    errors = None if meta["errors"] is None else {k: float(e) for k, e in meta["errors"]}
    return GroupScales(group, meta["alpha"], arrays["source_scales"], arrays["input_scales"]), errors


def recorded_scales(results: Results) -> dict[str, Any]:
    """The record's per-group parts every group-scale step writes alike: alpha, linears and the exact scales."""
    from qconvert.formats.record import RecordedScales

    scales = list(results.smoothing.values())
    return {"alpha": {g.group.source: g.alpha for g in scales},
            "groups": {g.group.source: tuple(g.group.linears) for g in scales},
            "scales": {g.group.source: RecordedScales(g.source_scales, g.input_scales, g.group.source_offset,
                                                      g.group.norm_offset) for g in scales}}
