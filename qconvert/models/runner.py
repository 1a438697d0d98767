"""Run a model one layer at a time from lazily read weights, observing every linear's input.

Only one layer's weights are alive at once: layer i's tensors are read from the
params Mapping just before the layer runs and dropped after, so a model larger
than memory can be calibrated. Each layer runs jit-compiled (one compile per
layer, since names and windows differ by layer); what the caller wants to know
about a linear's input comes out of the compiled layer as a functional output of
`observe`, so nothing leaks out of the trace.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats import QArray
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, dense_grouped_linear,
                                   dense_linear)

# observe(module_name, x [..., in], valid bool [...]) -> any pytree of arrays.
# `valid` marks the rows of x that come from real tokens (attention_mask) and,
# for experts, that were routed to that expert.
Observer = Callable[[str, jax.Array, jax.Array], Any]


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """What one layer did for one batch of samples."""

    index: int
    hidden: jax.Array               # the layer's output, float32 [B, T, H]
    observed: dict[str, list[Any]]  # module name -> observe(...) per micro-batch


def read_tensors(params: Mapping, names: Sequence[str]) -> dict[str, Any]:
    """Read `names` from a (possibly lazy) Mapping into jax arrays; QArrays stay QArrays."""
    out = {}
    for name in names:
        value = params[name]
        out[name] = value if isinstance(value, QArray) else jnp.asarray(np.asarray(value))
    return out


def _observing_hooks(linear: LinearHook, grouped_linear: GroupedLinearHook, observe: Observer,
                     token_valid: jax.Array, sink: dict[str, Any]):
    """Wrap the hooks so each call also stores observe(...) of its input in `sink`."""

    def observed_linear(name, x, weight, bias):
        valid = token_valid if token_valid.shape == x.shape[:-1] else jnp.ones(x.shape[:-1], bool)
        sink[name] = observe(name, x, valid)
        return linear(name, x, weight, bias)

    def observed_grouped(names, x, weights, group_sizes):
        ends = jnp.cumsum(group_sizes)
        rows = jnp.arange(x.shape[0])
        for e, name in enumerate(names):
            sink[name] = observe(name, x, (rows >= ends[e] - group_sizes[e]) & (rows < ends[e]))
        return grouped_linear(names, x, weights, group_sizes)

    return observed_linear, observed_grouped


def iterate_layers(model, params: Mapping, input_ids, attention_mask=None, *,
                   linear: LinearHook = dense_linear,
                   grouped_linear: GroupedLinearHook = dense_grouped_linear,
                   observe: Observer | None = None, batch_size: int | None = None,
                   jit: bool = True) -> Iterator[LayerResult]:
    """Embed `input_ids` [N, T], then yield each layer's LayerResult in order.

    The hidden states of all N samples pass from one layer to the next; a layer
    runs over them `batch_size` samples at a time (all at once when None), which
    bounds the attention scores' memory. The hooks must be traceable when
    `jit` is true (the float defaults and the kernels are); pass jit=False to
    run hooks with Python side effects eagerly. The generator reads layer i's
    weights only when the caller asks for layer i.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    n, t = input_ids.shape
    mask = jnp.ones((n, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    batch_size = n if batch_size is None else max(1, int(batch_size))
    observe = observe or (lambda name, x, valid: None)

    def run_layer(i, layer_params, hidden, mask):
        sink: dict[str, Any] = {}
        hooks = _observing_hooks(linear, grouped_linear, observe, mask > 0, sink)
        out = model.layer(i, layer_params, hidden, mask, *hooks)
        return out, sink

    step = jax.jit(run_layer, static_argnums=0) if jit else run_layer
    embed = jax.jit(model.embed) if jit else model.embed
    embed_params = read_tensors(params, model.embed_tensor_names())
    hidden = jnp.concatenate([embed(embed_params, input_ids[s:s + batch_size], mask[s:s + batch_size])
                              for s in range(0, n, batch_size)])
    del embed_params
    for i in range(model.num_layers):
        layer_params = read_tensors(params, model.layer_tensor_names(i))
        outs, observed = [], {}
        for s in range(0, n, batch_size):
            out, sink = step(i, layer_params, hidden[s:s + batch_size], mask[s:s + batch_size])
            outs.append(out)
            for name, value in sink.items():
                observed.setdefault(name, []).append(value)
        del layer_params
        hidden = jnp.concatenate(outs)
        yield LayerResult(i, hidden, observed)


def forward_layerwise(model, params: Mapping, input_ids, attention_mask=None, *,
                      linear: LinearHook = dense_linear,
                      grouped_linear: GroupedLinearHook = dense_grouped_linear,
                      batch_size: int | None = None, jit: bool = True) -> jax.Array:
    """model.forward computed layer by layer from lazily read weights (same result)."""
    hidden = None
    for result in iterate_layers(model, params, input_ids, attention_mask, linear=linear,
                                 grouped_linear=grouped_linear, batch_size=batch_size, jit=jit):
        hidden = result.hidden
    if hidden is None:
        hidden = model.embed(read_tensors(params, model.embed_tensor_names()), input_ids, attention_mask)
    head_params = read_tensors(params, model.head_tensor_names())
    mask = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)

    def head(head_params, hidden, mask):
        return model.head(head_params, hidden, mask, linear)

    return (jax.jit(head) if jit else head)(head_params, hidden, mask)
