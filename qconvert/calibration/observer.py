"""Calibration's statistics layer by layer: the float model run on calibration tokens, observing exactly the statistics asked for.

The statistics are objects (calibration/statistics.py); every run computes each linear's max|x| (float32 [in],
what smoothing needs, and where a non-finite input is refused) and whatever the steps ask for besides. All
samples' hidden states pass from layer i to layer i + 1, so only one layer's weights are in memory at a time,
beside the activations. The statistics file's format is formats/act_stats.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert import interrupts
from qconvert.calibration.memory import check_fits, checkpoint_shapes, device_budget, fit_batch_size, split_experts
from qconvert.formats.act_stats import ActStats
from qconvert.formats.errors import FormatError, InvalidCheckpointError
from qconvert.formats.checkpoint_params import CheckpointParams
from qconvert.formats.safetensors_io import open_checkpoint
from qconvert.calibration.device_sums import SUMMED, add_observed
from qconvert.calibration.expert_parallel import expert_stacks
from qconvert.calibration.layers import iterate_layers, read_tensors
from qconvert.calibration.statistics import (ATTENTION, INPUT, OUTPUT, SAMPLE_ROWS, InputAbsMax, Observed,
                                             RunShape, Statistic, layer_relative, merge_requests, statistics_asked)
from qconvert.models.registry import language_config

DEFAULT_BATCH_SIZE = 8
HOST_BUDGET_BYTES = 4 * 2**30  # what calibration may use when the device (a CPU) states no limit
CALIBRATING = "calibrating"  # the progress stage of the layers run through the float model


def open_params(folder: Path, config: dict[str, Any] | None = None) -> CheckpointParams:
    """A lazy params Mapping over a model folder's safetensors; with `config`, checked against it first."""
    from qconvert.source.consistency import check_weights_match_config

    try:
        params = CheckpointParams(open_checkpoint(folder))
    except FormatError as err:
        raise InvalidCheckpointError(str(err)) from None
    if config is not None:
        check_weights_match_config(params.checkpoint, config)
    return params


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One layer's statistics, complete once every sample has passed through it: each statistic's values by
    module (`of`)."""

    index: int
    values: dict[str, dict[str, Any]]  # statistic key -> module -> its value
    experts_split_over: int = 0  # the devices a MoE layer's experts were split over (0: not split)

    def of(self, statistic: Statistic | type[Statistic]) -> dict[str, Any]:
        """The values of `statistic` (an instance or its class) by module; {} where it was not asked for."""
        return self.values.get(statistic.key, {})


class StatisticsObserver:
    """The observer (calibration/layer_hooks.py) that computes exactly the statistics asked for, at their sites;
    it looks at outputs or attention only where a statistic does."""

    def __init__(self, statistics: Sequence[Statistic], run: RunShape):
        self.statistics, self.run = tuple(statistics), run
        sites = {s.site for s in self.statistics}
        if OUTPUT in sites:
            self.output = functools.partial(self._observe, OUTPUT)
        if ATTENTION in sites:
            self.attention = functools.partial(self._observe, ATTENTION)

    def __call__(self, name: str, x: jax.Array, valid: jax.Array) -> dict[str, Any]:
        return self._observe(INPUT, name, x, valid)

    def _observe(self, site: str, name: str, x, valid) -> dict[str, Any]:
        relative = layer_relative(name)
        listed, summed = {}, {}
        for stat in self.statistics:
            if stat.site == site and stat.wants(relative):
                entries, sums = stat.observe(name, x, valid, self.run)
                if entries:
                    listed[stat.key] = entries
                if sums:
                    summed[stat.key] = sums
        if summed:
            listed[SUMMED] = summed
        return listed


def check_calibration_fits(model, params: Mapping, config: Mapping, samples: int, seqlen: int, *,
                           hessians: bool = False,
                           sequential: bool = False, what: str = "calibrating",
                           flags: str = "--calib-samples or a shorter --calib-seqlen",
                           shard_experts: bool | None = None) -> None:
    """Before any window is made: UsageError when `samples` x `seqlen` tokens (the seqlen capped at the model's
    positions) cannot fit this process's first device, or this machine's memory on a CPU, even a window at a
    time (calibration_memory.check_fits), with a MoE layer's experts split over every device unless
    `shard_experts` is False."""
    if not hasattr(params, "checkpoint"):
        return
    positions = language_config(config).get("max_position_embeddings")
    seqlen = min(seqlen, int(positions)) if isinstance(positions, int) and positions > 0 else seqlen
    shapes, limit, devices = checkpoint_shapes(model, params), device_budget(jax.local_devices()[0]), jax.device_count()
    split = shard_experts if shard_experts is not None else split_experts(
        shapes, samples, seqlen, limit, devices=devices, hessians=hessians, sequential=sequential)
    check_fits(shapes, samples, seqlen, limit, hessians=hessians, sequential=sequential, what=what, flags=flags,
               devices=devices, experts_split=split)


def iter_layer_stats(model, params: Mapping, input_ids: np.ndarray, attention_mask=None, *,
                     batch_size: int = DEFAULT_BATCH_SIZE, statistics: Sequence[Statistic] | None = None,
                     keep_inputs=frozenset(), sample_rows: int = SAMPLE_ROWS, devices=None, hessians=frozenset(),
                     replace=None, shard_experts: bool | None = None) -> Iterator[LayerStats]:
    """Yield each layer's LayerStats in order, holding exactly `statistics` (merged; None: those of
    `statistics_asked(keep_inputs, hessians, sample_rows)`: every linear's max|x|, `keep_inputs` modules' kept
    rows and mean |x|, `hessians` modules' input Hessians for GPTQ).

    replace(i): after layer i's statistics are used, the tensors (name -> array) layer i
    is to run on from then on (its quantized weights), or None; the layer runs again on
    them to give layer i + 1 its input (layers.iterate_layers).

    devices: where the layers run; None: every visible device of jax's default backend, every process's in a
    run of several (with more than one, the batches are split across them and the statistics are the same as
    on one). `batch_size` is lowered where it would not fit the device (_fitted).

    shard_experts: split each MoE layer's experts over the devices (expert_parallel.py; the
    statistics then differ from one device's by float32 rounding); None: only where the layer would not fit a
    device that states its memory with every expert on it (calibration.memory.split_experts).
    """
    statistics = tuple(s.begin() for s in (statistics_asked(keep_inputs, hessians, sample_rows)
                                           if statistics is None else merge_requests(statistics)))
    n, t = np.asarray(input_ids).shape
    devices = jax.devices() if devices is None else devices
    on_device = any(s.held_on_device for s in statistics)
    batch_size, shard_experts = _fitted(model, params, n, t, batch_size, devices, on_device, replace is not None,
                                        shard_experts)
    split_over = _experts_split_over(model, devices, bool(shard_experts))
    observe = StatisticsObserver(statistics, RunShape(batches=math.ceil(n / max(1, batch_size))))
    result = None
    for result in iterate_layers(model, params, input_ids, attention_mask, observe=observe,
                                 batch_size=batch_size, devices=devices, replace=replace,
                                 shard_experts=bool(shard_experts)):
        interrupts.check()  # between layers: a signal that a callee swallowed still stops calibration
        yield LayerStats(result.index, _layer_values(result.observed, statistics), split_over)
    if result is not None:  # the last layer's output, on its replaced weights where it had some
        observed = _head_observed(model, params, result.hidden, attention_mask, observe, batch_size)
        if observed:
            yield LayerStats(model.num_layers, _layer_values(observed, statistics), split_over)


def _experts_split_over(model, devices, shard_experts: bool) -> int:
    """The devices MoE layers' experts are split over (0: not split, or no MoE layer)."""
    moe = any(expert_stacks(model.layer_tensor_names(i)) for i in range(model.num_layers))
    return len(devices) if shard_experts and len(devices) > 1 and moe else 0


def _fitted(model, params: Mapping, n: int, t: int, batch_size: int, devices, on_device: bool, sequential: bool,
            shard_experts: bool | None) -> tuple[int, bool | None]:
    """(the batch size that fits, whether to split experts) from the checkpoint's shapes (nothing read); as
    given where params has no checkpoint index. Refuses, before any work, what cannot fit a device that states
    its memory."""
    if not hasattr(params, "checkpoint"):
        return batch_size, shard_experts
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    stated = device_budget(local[0])
    shapes = checkpoint_shapes(model, params)
    if shard_experts is None:
        shard_experts = split_experts(shapes, n, t, stated, devices=len(devices), hessians=on_device,
                                      sequential=sequential)
    batch_size = fit_batch_size(shapes, n, t, batch_size, stated or HOST_BUDGET_BYTES, hessians=on_device,
                                sequential=sequential, devices=len(devices), experts_split=bool(shard_experts))
    if stated is not None:
        check_fits(shapes, n, t, stated, hessians=on_device, sequential=sequential, devices=len(devices),
                   experts_split=bool(shard_experts))
    return batch_size, shard_experts


def _layer_values(observed: dict[str, list], statistics: Sequence[Statistic]) -> dict[str, dict[str, Any]]:
    """Each statistic's values by module from a layer's observations (summed entries stay on the device; the
    rest comes to the host in one transfer)."""
    sums = {name: per_batch[0].pop(SUMMED) for name, per_batch in observed.items()
            if per_batch and isinstance(per_batch[0], dict) and SUMMED in per_batch[0]}
    observed = jax.device_get(observed)
    values = {}
    for stat in statistics:
        values[stat.key] = stat.values({
            name: Observed([entry[stat.key] for entry in per_batch if isinstance(entry, dict) and stat.key in entry],
                           sums.get(name, {}).get(stat.key))
            for name, per_batch in observed.items()})
    return values


def _head_observed(model, params: Mapping, hidden: jax.Array, attention_mask, observe,
                   batch_size: int) -> dict[str, list]:
    """Observe the inputs of the head's linears (lm_head, for --include lm_head) without computing logits."""
    head_params = read_tensors(params, model.head_tensor_names())

    def run(head_params, hidden, mask):
        sink = {}

        def observe_only(name, x, weight, bias):
            sink[name] = observe(name, x, mask > 0)
            return jnp.zeros(x.shape[:-1] + (weight.shape[0],), jnp.float32)

        model.head(head_params, hidden, mask, observe_only)
        return sink

    step = jax.jit(run)
    n, t = hidden.shape[:2]
    mask = jnp.ones((n, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    observed: dict[str, list] = {}
    for s in range(0, n, max(1, batch_size)):
        for name, value in step(head_params, hidden[s:s + batch_size], mask[s:s + batch_size]).items():
            add_observed(observed, name, value)
    return observed


def collect_act_stats(model, params: Mapping, input_ids: np.ndarray, attention_mask=None, *,
                      batch_size: int = DEFAULT_BATCH_SIZE, shard_experts: bool | None = None,
                      calibration: dict[str, Any] | None = None, progress=None) -> ActStats:
    """Per-channel max|x| of every linear's input over all samples, layer by layer (`progress` hears each)."""
    from qconvert.progress import as_reporter

    progress = as_reporter(progress)
    act_absmax: dict[str, np.ndarray] = {}
    progress.step(CALIBRATING, 0, model.num_layers)
    split_over = 0
    for layer in iter_layer_stats(model, params, input_ids, attention_mask, batch_size=batch_size,
                                  shard_experts=shard_experts):
        act_absmax.update(layer.of(InputAbsMax))
        split_over = layer.experts_split_over
        if layer.index < model.num_layers:  # the last LayerStats holds the head's inputs: no layer of its own
            progress.step(CALIBRATING, layer.index + 1, model.num_layers)
    if split_over and calibration is not None:
        calibration = {**calibration, "experts_split_over": split_over}
    tokens = int(np.sum(attention_mask)) if attention_mask is not None else int(np.asarray(input_ids).size)
    return ActStats(act_absmax, tokens, calibration)


