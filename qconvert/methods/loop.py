"""The per-layer loop: calibration runs the float model a layer at a time, and each step runs on each layer as soon
as that layer's statistics are complete. The loop knows no method; a method is a `Step`.

A step says which statistics it needs (calibration/statistics.py: kept input rows, Hessians, mean |x|,
attention's keys and values, ...), may transform the whole model before calibration, and does its work on a
layer given the results of the steps before it, which it reads from and adds to the shared `Results`
(SmoothQuant's scales, the searched clips, ...). Steps run in the order given, layer after layer: GPTQ, after
SmoothQuant and the clip search, rounds the weights as smoothed and clipped. With `replacement`, a step hands
the runner a layer's new weights, and the next layer is calibrated on that layer's outputs as rewritten
(sequential rounding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from qconvert.calibration.observer import CALIBRATING, LayerStats, iter_layer_stats
from qconvert.calibration.statistics import InputAbsMax, Statistic
from qconvert.methods.fold import GroupScales, TensorFold, tensor_folds
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
    input_scales: dict[str, float] | None = None  # module -> its static per-tensor input scale (--act static)
    # Tensors calibration adds to the folder (name -> array), e.g. the KV cache's scales, and the config part
    # that says what they mean (quantization_config key -> value).
    extra_tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    records: dict[str, Any] = dataclasses.field(default_factory=dict)  # qconvert.json's parts steps add
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


# A transform of the whole model: (tensor name, its array) -> the array as the transformed model holds it (same
# shape and dtype); e.g. a rotation folded into the weights. Applied to every tensor read, by calibration and by
# the writer alike.
ModelTransform = Callable[[str, np.ndarray], np.ndarray]


class Step:
    """One method of the calibration stage, run on each layer once that layer's statistics are complete. The
    base does nothing at every hook: a method writes only the hooks it uses."""

    rewrites = False  # whether the step hands the runner new weights for a layer (`replacement`)
    stage = ""        # the step's progress stage, counted in `unit`s (stage_total: how many)
    unit = "layers"
    _progress: Reporter | None = None

    def model_transform(self, params: Mapping) -> ModelTransform | None:
        """A transform of the whole model, applied before calibration (to what every later step and the writer
        read), or None."""
        return None

    def statistics(self) -> Sequence[Statistic]:
        """The statistics (calibration/statistics.py) the step reads from each layer."""
        return ()

    def stage_total(self) -> int:
        """How many units the step's stage counts (0: the step has no work and shows no stage)."""
        return 0

    def start(self, progress: Reporter) -> None:
        """Show the step's progress stage (nothing for a step with no work)."""
        self._progress = progress
        if self.stage and self.stage_total():
            progress.step(self.stage, 0, self.stage_total(), self.unit)

    def advance(self, done: int) -> None:
        """Show `done` of the stage's units finished."""
        self._progress.step(self.stage, done, self.stage_total(), self.unit)

    def layer(self, stats: LayerStats, results: Results) -> None:
        """Do the step's work on what of `stats` is ready, adding to `results`."""

    def finish(self, results: Results) -> None:
        """Complete what the layers left (or, with no calibration run, everything) from `results`."""

    def replacement(self, index: int) -> Mapping | None:
        """The weights (name -> array) layer `index` runs on again after the step, or None."""
        return None


class TransformedParams(Mapping):
    """A params Mapping as a model transform leaves it: each tensor transformed when read; shapes (the
    checkpoint's index, `checkpoint`) as the source's."""

    def __init__(self, params: Mapping, transform: ModelTransform):
        self.params, self.transform = params, transform
        if hasattr(params, "checkpoint"):
            self.checkpoint = params.checkpoint

    def __getitem__(self, name: str):
        return self.transform(name, np.asarray(self.params[name]))

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def transform_model(steps: Sequence[Step], results: Results) -> ModelTransform | None:
    """Each step's whole-model transform, in step order, applied to `results.params` (what calibration and
    the steps read); the composed transform for the writer, or None where no step transforms."""
    transforms = []
    for step in steps:
        transform = step.model_transform(results.params)
        if transform is not None:
            transforms.append(transform)
            results.params = TransformedParams(results.params, transform)
    if not transforms:
        return None

    def composed(name: str, array: np.ndarray) -> np.ndarray:
        for transform in transforms:
            array = transform(name, array)
        return array

    return composed


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The tokens the loop runs and how: [samples, seqlen] ids, and windows per forward (None: the default)."""

    input_ids: np.ndarray
    batch_size: int | None = None
    shard_experts: bool | None = None  # MoE layers' experts split over the devices (None: where they do not fit)


def run_layers(model, calibration: Calibration, steps: Sequence[Step], results: Results,
               progress: Reporter) -> None:
    """Calibrate `model` a layer at a time, each layer's statistics handed to every step in order."""
    asked = [InputAbsMax(), *(stat for step in steps for stat in step.statistics())]
    batching = {} if calibration.batch_size is None else {"batch_size": calibration.batch_size}
    progress.step(CALIBRATING, 0, model.num_layers)
    for step in steps:
        step.start(progress)
    for stats in iter_layer_stats(model, results.params, calibration.input_ids, statistics=asked,
                                  replace=_replacement(steps), shard_experts=calibration.shard_experts, **batching):
        results.act_absmax.update(stats.of(InputAbsMax))
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
