"""The per-layer loop: calibration runs the float model a layer at a time, and each step runs on each layer as soon
as that layer's statistics are complete. The loop knows no method; a method is a `Step`.

A step says which statistics it needs (input rows kept per linear, input Hessians), and does its work on a
layer given the results of the steps before it, which it reads from and adds to the shared `Results`
(SmoothQuant's scales, the searched clips, ...). Steps run in the order given, layer after layer: GPTQ, after
SmoothQuant and the clip search, rounds the weights as smoothed and clipped. With `replacement`, a step hands
the runner a layer's new weights, and the next layer is calibrated on that layer's outputs as rewritten
(sequential rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from qconvert.calibration.observer import CALIBRATING, LayerStats, iter_layer_stats
from qconvert.methods.smooth import GroupScales, TensorFold, tensor_folds
from qconvert.progress import Reporter


@dataclasses.dataclass
class Results:
    """What the steps have found so far, each step adding its own part for the steps after it."""

    params: Mapping                                        # the source's tensors, read lazily
    act_absmax: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # every linear's max|x| so far
    smoothing: dict[str, GroupScales] = dataclasses.field(default_factory=dict)  # group source -> its scales
    unsmoothed: set[str] = dataclasses.field(default_factory=set)  # modules a pending smoothing group touches
    clips: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)      # module -> weight clip ratios
    searches: dict[str, Any] = dataclasses.field(default_factory=dict)  # module -> its LinearSearch (scale_search)
    smoothing_record: Any = None  # qconvert.json's `smoothing` (formats.record.SmoothingRecord), once smoothed
    experts_split_over: int = 0   # the devices calibration split MoE layers' experts over (0: not split)

    def folds(self) -> dict[str, TensorFold]:
        """The smoothing chosen so far, as a fold per tensor it touches."""
        return tensor_folds(list(self.smoothing.values()))


def weight_shape(params: Mapping, module: str) -> tuple[int, ...]:
    """A linear's weight shape, from the checkpoint's index where there is one (nothing read)."""
    checkpoint = getattr(params, "checkpoint", None)
    name = f"{module}.weight"
    return tuple(int(d) for d in (checkpoint.shape(name) if checkpoint is not None else np.shape(params[name])))


def weight_elements(params: Mapping, module: str) -> int:
    """The element count of a linear's weight: what the steps weigh their work by when they spread it over the
    devices."""
    return int(np.prod(weight_shape(params, module)))


class Step(Protocol):
    """One method of the calibration stage, run on each layer once that layer's statistics are complete."""

    rewrites: bool  # whether the step hands the runner new weights for a layer (`replacement`)

    def kept_rows(self) -> set[str]:
        """The linears whose input rows (a sample of calibration tokens) the step reads."""

    def hessians(self) -> frozenset[str]:
        """The linears whose input Hessians the step reads."""

    def start(self, progress: Reporter) -> None:
        """Show the step's progress stage (nothing for a step with no work)."""

    def layer(self, stats: LayerStats, results: Results) -> None:
        """Do the step's work on what of `stats` is ready, adding to `results`."""

    def finish(self, results: Results) -> None:
        """Complete what the layers left (or, with no calibration run, everything) from `results`."""

    def replacement(self, index: int) -> Mapping | None:
        """The weights (name -> array) layer `index` runs on again after the step, or None."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The tokens the loop runs and how: [samples, seqlen] ids, and windows per forward (None: the default)."""

    input_ids: np.ndarray
    batch_size: int | None = None
    shard_experts: bool | None = None  # MoE layers' experts split over the devices (None: where they do not fit)


def run_layers(model, calibration: Calibration, steps: Sequence[Step], results: Results,
               progress: Reporter) -> None:
    """Calibrate `model` a layer at a time, each layer's statistics handed to every step in order."""
    keep = set().union(*(step.kept_rows() for step in steps))
    hessians = frozenset().union(*(step.hessians() for step in steps))
    batching = {} if calibration.batch_size is None else {"batch_size": calibration.batch_size}
    progress.step(CALIBRATING, 0, model.num_layers)
    for step in steps:
        step.start(progress)
    for stats in iter_layer_stats(model, results.params, calibration.input_ids, keep_inputs=keep,
                                  hessians=hessians, replace=_replacement(steps),
                                  shard_experts=calibration.shard_experts, **batching):
        results.act_absmax.update(stats.act_absmax)
        results.experts_split_over = stats.experts_split_over
        if stats.index < model.num_layers:  # the last LayerStats holds the head's inputs
            progress.step(CALIBRATING, stats.index + 1, model.num_layers)
        for step in steps:
            step.layer(stats, results)


def _replacement(steps: Sequence[Step]) -> Callable[[int], Mapping | None] | None:
    """The runner's `replace`: each rewriting step's new weights of a layer, merged; None when no step rewrites
    (the layers then run once)."""
    rewriting = [step for step in steps if step.rewrites]
    if not rewriting:
        return None

    def replace(index: int) -> Mapping | None:
        found = [r for r in (step.replacement(index) for step in rewriting) if r]
        return {name: array for r in found for name, array in r.items()} or None

    return replace
