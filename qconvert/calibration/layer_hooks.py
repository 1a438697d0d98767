"""The hooks a calibrated layer runs through: each linear, grouped linear and attention cache also observed.

observe(name, x [..., in], valid bool [...]) -> any pytree of arrays, for a linear's input; `valid` marks the
rows of x that come from real tokens (attention_mask) and, for experts, that were routed to that expert. An
observer may also have `output(name, y, valid)` (a linear's output) and `attention(name, (keys, values),
valid)` (an attention block's keys after RoPE and values, [B, heads, T, head_dim], as the KV cache holds
them); a plain callable observes inputs only. What each returns for one module is kept under its name in
the layer's sink (merged, for a linear observed at its input and output).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from qconvert.calibration.device_sums import merge_observations, split_summed
from qconvert.models.hooks import GroupedLinearHook, LinearHook

Observer = Callable[[str, jax.Array, jax.Array], Any]


def expert_rows(group_sizes: jax.Array, rows: int) -> list[jax.Array]:
    """Per expert, which of `rows` sorted rows are its own (bool [rows] each)."""
    ends, index = jnp.cumsum(group_sizes), jnp.arange(rows)
    return [(index >= ends[e] - group_sizes[e]) & (index < ends[e]) for e in range(group_sizes.shape[0])]


def observe_experts(observe: Observer, names, x: jax.Array, y: jax.Array | None, group_sizes: jax.Array,
                    sink: dict[str, Any], *, listed_only: bool = False) -> None:
    """Each expert's observation of its rows of x (and, where the observer looks at outputs, of y) into
    `sink`; with `listed_only`, less the summed entries (summed elsewhere)."""
    output = getattr(observe, "output", None)
    for name, valid in zip(names, expert_rows(group_sizes, x.shape[0])):
        value = observe(name, x, valid)
        if output is not None and y is not None:
            value = merge_observations(value, output(name, y, valid))
        sink[name] = split_summed(value)[0] if listed_only else value


def observing_hooks(linear: LinearHook, grouped_linear: GroupedLinearHook, observe: Observer,
                    token_valid: jax.Array, sink: dict[str, Any]) -> tuple[LinearHook, GroupedLinearHook]:
    """Wrap the hooks so each call also stores what `observe` returns of it in `sink`."""
    output = getattr(observe, "output", None)

    def observed_linear(name, x, weight, bias):
        valid = token_valid if token_valid.shape == x.shape[:-1] else jnp.ones(x.shape[:-1], bool)
        value = observe(name, x, valid)
        y = linear(name, x, weight, bias)
        sink[name] = value if output is None else merge_observations(value, output(name, y, valid))
        return y

    def observed_grouped(names, x, weights, group_sizes):
        y = grouped_linear(names, x, weights, group_sizes)
        observe_experts(observe, names, x, y, group_sizes, sink)
        return y

    return observed_linear, observed_grouped


def attention_observer(observe: Observer, token_valid: jax.Array, sink: dict[str, Any]):
    """The attention tap (models.hooks.cached_kv) that stores observe.attention(...) of each block's keys and
    values in `sink`; None when the observer does not look at attention."""
    attention = getattr(observe, "attention", None)
    if attention is None:
        return None

    def tap(name, keys, values):
        sink[name] = attention(name, (keys, values), token_valid)
        return keys, values

    return tap
