"""Activation statistics: run calibration tokens through the float model one layer at a time and keep max|x| of every linear's input.

For each linear, the running per-input-channel max|x| over all calibration
tokens (float32 [in], what smoothing needs) and the per-tensor max (what static
activation scales need). All samples' hidden states pass from layer i to layer
i + 1, so only one layer's weights are in memory at a time, beside the
activations. The statistics file's format is formats/act_stats.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert import interrupts
from qconvert.calibration.memory import check_fits, checkpoint_shapes, device_budget, fit_batch_size, split_experts
from qconvert.formats.act_stats import ActStats
from qconvert.formats.errors import FormatError, InvalidCheckpointError, InvalidWeightError
from qconvert.formats.checkpoint_params import CheckpointParams
from qconvert.formats.safetensors_io import open_checkpoint
from qconvert.models import iterate_layers, read_tensors
from qconvert.models.registry import language_config
from qconvert.models.runner import add_observed, expert_stacks

DEFAULT_BATCH_SIZE = 8
SAMPLE_ROWS = 512  # tokens kept per linear input for the alpha and scale searches
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
    """One layer's statistics, complete once every sample has passed through it."""

    index: int
    act_absmax: dict[str, np.ndarray]      # module -> float32 [in]
    input_samples: dict[str, np.ndarray]   # module -> float32 [rows, in], for the modules asked for
    # module -> H = 2 X^T X / n, float32 [in, in] on the device, for the modules asked for; linears that
    # read the same input (q/k/v, gate/up) hold the same array. X: the tokens each saw, every window's first
    # left out but for q/k/v (hessian_sum); n: their count (0: none).
    hessians: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    hessian_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    # module -> mean |x| per input channel over every calibration token it saw (float32 [in]), for the modules
    # whose rows are kept; absent for one no token reached.
    input_abs_mean: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    experts_split_over: int = 0  # the devices a MoE layer's experts were split over (0: not split)


def layer_relative(name: str) -> str:
    """A module name with its layer index replaced by '#' (the first '.<digits>.' component).

    Layers that share a compiled program see one representative layer's names;
    what the observer keeps must be decided alike for every layer.
    """
    return _LAYER_INDEX.sub(".#.", name, count=1)


_LAYER_INDEX = re.compile(r"\.\d+\.")


class _HessianSharing:
    """Which linears of a traced layer read the very same input (and validity) as an earlier one: they share
    its Hessian, computed once. Filled while tracing, by layer-relative name."""

    def __init__(self):
        self.first: dict[tuple[int, int], tuple[str, Any, Any]] = {}
        self.shares: dict[str, str] = {}  # layer-relative name -> the layer-relative name holding its H

    def owner(self, relative: str, x, valid) -> str:
        key = (id(x), id(valid))
        seen = self.first.get(key)
        if seen is not None and seen[1] is x and seen[2] is valid:  # held, so the ids are not reused
            self.shares[relative] = seen[0]
            return seen[0]
        self.first[key] = (relative, x, valid)
        return relative


def _observer(keep_inputs: frozenset[str], rows_per_batch: int, hessians: frozenset[str] = frozenset(),
              sharing: _HessianSharing | None = None):
    keep_relative = frozenset(layer_relative(m) for m in keep_inputs)
    hessian_relative = frozenset(layer_relative(m) for m in hessians)

    def observe(name: str, x: jax.Array, valid: jax.Array) -> dict[str, jax.Array]:
        flat = x.astype(jnp.float32).reshape(-1, x.shape[-1])
        ok = valid.reshape(-1)
        # Padding (and, for experts, tokens routed elsewhere) count as 0 in the max.
        magnitude = jnp.where(ok[:, None], jnp.abs(flat), 0.0)  # one array for both reductions (one fusion)
        out = {"absmax": jnp.max(magnitude, axis=0)}
        relative = layer_relative(name)
        if relative in hessian_relative and sharing.owner(relative, x, valid) == relative:
            out["hessian"], out["count"] = hessian_sum(x, valid, window_start=reads_attention_input(name))
        if layer_relative(name) in keep_relative:
            # A spread subset of the tokens. The first ones alone over-represent
            # position 0, whose activations are often atypically large; so does a
            # stride that divides the window length (every row at position 0), so
            # the step is one more than the even stride and the positions vary.
            n = flat.shape[0]
            step = n // rows_per_batch + 1 if n > rows_per_batch else 1
            index = (np.arange(min(rows_per_batch, n)) * step) % n
            out["rows"] = flat[index]
            out["valid"] = ok[index]
            # sum |x| over every valid token (AWQ's act_mean), beside the sample of rows.
            out["abs_sum"] = jnp.sum(magnitude, axis=0)
            out["tokens"] = jnp.sum(ok.astype(jnp.int32))
        return out

    return observe


# The linears that compute an attention block's queries, keys and values (fused or not, low-rank or not, in
# the families' spellings): the keys and values every later token attends to come out of them.
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "W_pack", "Wqkv", "c_attn",
                    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "query", "key", "value")


def reads_attention_input(name: str) -> bool:
    """Whether linear `name` computes queries, keys or values from an attention block's input."""
    return name.rsplit(".", 1)[-1] in ATTENTION_INPUTS


def hessian_sum(x: jax.Array, valid: jax.Array, *, window_start: bool = False) -> tuple[jax.Array, jax.Array]:
    """(X^T X float32 [in, in], n) of a linear's input x [..., in] over its valid tokens; GPTQ's Hessian is
    2 X^T X / n. Without `window_start`, the first token of every calibration window is left out.

    A trained LLM's first token is an attention sink: its activations reach thousands in a few channels, so its
    rows can hold most of X^T X (SmolLM2-135M: 79% of layer 28's down_proj input, 98% of layer 11's), and GPTQ,
    minimising the output error those rows dominate, fitted that one token per window while the other tokens'
    error rose to 2.5x round-to-nearest's (docs/ACCURACY.md). The sink's key and value are read by every later
    token, so q/k/v keep it (`window_start`; there its rows hold under 1% of X^T X); its o_proj and MLP
    outputs move only its own residual stream. x [windows, seqlen, in] is a dense linear's input; an expert's
    [tokens, in] input has lost its positions and keeps every valid token.
    """
    flat = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    counted = valid.reshape(-1)
    if x.ndim == 3 and not window_start:
        counted = counted & jnp.broadcast_to(jnp.arange(x.shape[1]) > 0, x.shape[:2]).reshape(-1)
    masked = jnp.where(counted[:, None], flat, 0.0)
    return (jnp.einsum("ti,tj->ij", masked, masked, precision=jax.lax.Precision.HIGHEST),
            jnp.sum(counted.astype(jnp.int32)))


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
                     batch_size: int = DEFAULT_BATCH_SIZE, keep_inputs=frozenset(),
                     sample_rows: int = SAMPLE_ROWS, devices=None, hessians=frozenset(),
                     replace=None, shard_experts: bool | None = None) -> Iterator[LayerStats]:
    """Yield each layer's LayerStats in order; `keep_inputs` modules also get up to `sample_rows` input rows,
    `hessians` modules their input Hessian (for GPTQ).

    replace(i): after layer i's statistics are used, the tensors (name -> array) layer i
    is to run on from then on (its quantized weights), or None; the layer runs again on
    them to give layer i + 1 its input (runner.iterate_layers).

    devices: where the layers run; None: every visible device of jax's default
    backend, every process's in a run of several (with more than one, the
    batches are split across them and the statistics are the same as on one). `batch_size` is lowered where the
    estimate of calib_memory says it would not fit the device (its allocator's
    limit; on a CPU, HOST_BUDGET_BYTES).

    shard_experts: split each MoE layer's experts over the devices (runner._expert_parallel_step; the
    statistics then differ from one device's by float32 rounding); None: only where the layer would not fit a
    device that states its memory with every expert on it (calibration.memory.split_experts).
    """
    keep_inputs = frozenset(keep_inputs)
    n, t = np.asarray(input_ids).shape
    devices = jax.devices() if devices is None else devices
    if hasattr(params, "checkpoint"):  # shapes from the index, no tensor read
        local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
        stated = device_budget(local[0])
        shapes = checkpoint_shapes(model, params)
        if shard_experts is None:
            shard_experts = split_experts(shapes, n, t, stated, devices=len(devices), hessians=bool(hessians),
                                          sequential=replace is not None)
        batch_size = fit_batch_size(shapes, n, t, batch_size, stated or HOST_BUDGET_BYTES,
                                    hessians=bool(hessians), sequential=replace is not None, devices=len(devices),
                                    experts_split=bool(shard_experts))
        if stated is not None:  # a device that states its memory: refuse what cannot fit it, before any work
            check_fits(shapes, n, t, stated, hessians=bool(hessians), sequential=replace is not None,
                       devices=len(devices), experts_split=bool(shard_experts))
    batches = math.ceil(n / max(1, batch_size))
    split_over = len(devices) if shard_experts and len(devices) > 1 and any(
        expert_stacks(model.layer_tensor_names(i)) for i in range(model.num_layers)) else 0
    sharing = _HessianSharing()
    observe = _observer(keep_inputs, max(1, math.ceil(sample_rows / batches)), frozenset(hessians), sharing)
    result = None
    for result in iterate_layers(model, params, input_ids, attention_mask, observe=observe,
                                 batch_size=batch_size, devices=devices, replace=replace,
                                 shard_experts=bool(shard_experts)):
        interrupts.check()  # between layers: a signal that a callee swallowed still stops calibration
        yield dataclasses.replace(_layer_stats(result.index, result.observed, keep_inputs, sample_rows, sharing),
                                  experts_split_over=split_over)
    if result is not None:  # the last layer's output, on its replaced weights where it had some
        observed = _head_observed(model, params, result.hidden, attention_mask, observe, batch_size)
        if observed:
            yield dataclasses.replace(_layer_stats(model.num_layers, observed, keep_inputs, sample_rows, sharing),
                                      experts_split_over=split_over)


def _layer_stats(index: int, observed: dict[str, list], keep_inputs: frozenset[str],
                 sample_rows: int, sharing: _HessianSharing | None = None) -> LayerStats:
    sums = {name: (per_batch[0].pop("hessian"), per_batch[0].pop("count"))
            for name, per_batch in observed.items() if "hessian" in per_batch[0]}  # stay on the device
    observed = jax.device_get(observed)  # the layer's statistics to the host in one transfer
    absmax, samples, abs_mean = {}, {}, {}
    for name, per_batch in observed.items():
        absmax[name] = np.max(np.stack([np.asarray(o["absmax"]) for o in per_batch]), axis=0)
        if not np.isfinite(absmax[name]).all():  # checked where it appears: no step ever sees NaN statistics
            raise InvalidWeightError(
                f"calibration: the input of {name} holds NaN or Inf: the float model overflows there, or a weight "
                "before it is not finite; fix the checkpoint")
        if name in keep_inputs:
            rows = np.concatenate([np.asarray(o["rows"])[np.asarray(o["valid"])] for o in per_batch])
            samples[name] = rows[:sample_rows]
            # Each batch's sum, added in batch order in float64: the same whatever device ran which batch.
            count = sum(int(o["tokens"]) for o in per_batch)
            if count:
                total = np.sum(np.stack([np.asarray(o["abs_sum"], np.float64) for o in per_batch]), axis=0)
                abs_mean[name] = (total / count).astype(np.float32)
    hessians, tokens = {}, {}
    by_relative = {layer_relative(name): name for name in observed}
    for name in observed:
        owner = by_relative.get(sharing.shares.get(layer_relative(name), ""), name) if sharing else name
        if owner in sums:
            total, count = sums[owner]
            tokens[name] = int(count)
            if owner not in hessians:
                hessians[owner] = total * (2.0 / max(tokens[name], 1))
            hessians[name] = hessians[owner]
    return LayerStats(index, absmax, samples, hessians, tokens, abs_mean)


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
        act_absmax.update(layer.act_absmax)
        split_over = layer.experts_split_over
        if layer.index < model.num_layers:  # the last LayerStats holds the head's inputs: no layer of its own
            progress.step(CALIBRATING, layer.index + 1, model.num_layers)
    if split_over and calibration is not None:
        calibration = {**calibration, "experts_split_over": split_over}
    tokens = int(np.sum(attention_mask)) if attention_mask is not None else int(np.asarray(input_ids).size)
    return ActStats(act_absmax, tokens, calibration)


