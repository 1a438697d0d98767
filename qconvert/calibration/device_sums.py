"""Observations summed over batches and devices in batch order, so a sum holds the same floats on any mesh.

An observation (what `observe` returns for one module and one batch) is any pytree; a dict may hold, under
SUMMED, entries that are summed over the batches instead of listed, each a scalar or a square matrix (a
running sum is all they need, and a list would hold one [in, in] matrix per batch). The engine knows no entry
by name: the statistics (calibration/statistics.py) choose what goes under SUMMED.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUMMED = "summed"


def split_summed(value: Any) -> tuple[Any, Any]:
    """(the observation less its summed entries, its summed entries or None)."""
    if not isinstance(value, dict) or SUMMED not in value:
        return value, None
    return {k: v for k, v in value.items() if k != SUMMED}, value[SUMMED]


def add_observed(observed: dict[str, list[Any]], name: str, value: Any) -> None:
    """Append one batch's observation of `name`; its summed entries add into the first batch's."""
    entries = observed.setdefault(name, [])
    rest, summed = split_summed(value)
    if not entries or summed is None:
        entries.append(value)
        return
    first = entries[0]
    first[SUMMED] = jax.tree.map(lambda a, b: a + b, first[SUMMED], summed)
    if rest:
        entries.append(rest)


def merge_observations(a: Any, b: Any) -> Any:
    """Two observations of one module (its input's and its output's) as one dict."""
    if a is None or a == {}:
        return b
    if b is None or b == {}:
        return a
    rest_a, sum_a = split_summed(a)
    rest_b, sum_b = split_summed(b)
    merged = {**rest_a, **rest_b}
    if sum_a is not None or sum_b is not None:
        merged[SUMMED] = {**(sum_a or {}), **(sum_b or {})}
    return merged


def split_sink(sink: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A traced layer's observations as (each module's summed entries, for the modules with some; every
    module's observation less them)."""
    sums, rest = {}, {}
    for name, value in sink.items():
        rest[name], summed = split_summed(value)
        if summed is not None:
            sums[name] = summed
    return sums, rest


def fold_sums(sums: dict[str, Any], running: dict[str, Any] | None, fold, devices: int) -> dict[str, Any]:
    """Each summed entry folded into its running sum (None: the first group) by `fold(value, running,
    devices)`."""
    if running is None:
        return jax.tree.map(lambda v: fold(v, None, devices), sums)
    return jax.tree.map(lambda v, r: fold(v, r, devices), sums, {name: running[name] for name in sums})


def add_sums(first: dict, sums: Any) -> None:
    """Summed entries gathered from the devices, placed where one device's first batch entry holds them."""
    first[SUMMED] = sums


def ordered_fold(value: jax.Array, running: jax.Array | None, devices: int) -> jax.Array:
    """Inside shard_map over `data`: this group's values (one batch per device, device order = batch order) added
    to the running sum in batch order, as add_observed adds them on one device: ((running + v_0) + v_1) + ...
    (v_0 + v_1 + ... in the first group). Each device folds one block of rows of every device's value (an
    all-to-all: each sends and receives about one value's bytes) and keeps that block of the sum: [rows / devices
    rounded up, in], the last block padded. A scalar (a count) is all-gathered and held whole: [1] per device.
    `running` is this function's earlier result."""
    if value.ndim == 0:
        return in_batch_order(jax.lax.all_gather(value, "data"), None if running is None else running[0])[None]
    if value.ndim != 2 or value.shape[0] != value.shape[1]:
        raise ValueError(f"a summed observation is a scalar or a square matrix, not {value.shape}")
    rows, width = value.shape
    block = -(-rows // devices)
    padded = jnp.pad(value, [(0, block * devices - rows), (0, 0)])
    parts = jax.lax.all_to_all(padded, "data", 0, 0, tiled=True).reshape(devices, block, width)
    return in_batch_order(parts, running)


def replicated_fold(value: jax.Array, running: jax.Array | None, devices: int) -> jax.Array:
    """ordered_fold's result for a batch every device ran (each holds the same value): this device's block of
    it added to its block of the running sum."""
    if value.ndim == 0:
        return (value if running is None else running[0] + value)[None]
    rows, width = value.shape
    block = -(-rows // devices)
    padded = jnp.pad(value, [(0, block * devices - rows), (0, 0)])
    mine = jax.lax.dynamic_slice(padded, (jax.lax.axis_index("data") * block, 0), (block, width))
    return mine if running is None else running + mine


def in_batch_order(parts: jax.Array, running: jax.Array | None) -> jax.Array:
    """((running + parts[0]) + parts[1]) + ...; parts[0] + parts[1] + ... without a running sum."""
    total = parts[0] if running is None else running + parts[0]
    for j in range(1, parts.shape[0]):
        total = total + parts[j]
    return total


def unfolded(value: np.ndarray) -> np.ndarray:
    """A sum ordered_fold left over the devices, gathered: the array as one device's sum holds it (a scalar's
    copies, one per device, are one; a square matrix's padded rows go)."""
    return value[0] if value.ndim == 1 else value[:value.shape[1]]
