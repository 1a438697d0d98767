"""Run a model one layer at a time from lazily read weights, observing every linear's input.

Only one layer's weights are alive at once: layer i's tensors are read from the
params Mapping just before the layer runs and dropped after, so a model larger
than memory can be calibrated. Layers run jit-compiled, one program per layer
signature (the family's `layer_signature(i)`: e.g. sliding-window against global
attention), not per layer: names are mapped outside the trace. What the caller
wants to know about a linear's input comes out of the compiled layer as a
functional output of `observe`, so nothing leaks out of the trace. With several
devices the batches are split across them (data parallel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qconvert.formats import QArray
from qconvert.formats.qarray import is_prepared
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, dense_grouped_linear,
                                   dense_linear)

# observe(module_name, x [..., in], valid bool [...]) -> any pytree of arrays.
# `valid` marks the rows of x that come from real tokens (attention_mask) and,
# for experts, that were routed to that expert.
Observer = Callable[[str, jax.Array, jax.Array], Any]


# Keys of what `observe` returns that are summed over the batches (on the device) instead of listed:
# a running sum is all they need, and a list would hold one [in, in] matrix per batch.
SUMMED = ("hessian", "count")


@dataclasses.dataclass
class LayerResult:
    """What one layer did for one batch of samples.

    `hidden` is replaced by the layer's output on its new weights when the caller's
    `replace` hands some in (sequential quantization).
    """

    index: int
    hidden: jax.Array               # the layer's output, float32 [B, T, H]
    observed: dict[str, list[Any]]  # module name -> observe(...) per micro-batch (SUMMED keys: one sum)


def read_tensors(params: Mapping, names: Sequence[str]) -> dict[str, Any]:
    """Read `names` from a (possibly lazy) Mapping into jax arrays; QArrays (and prepared weights) stay as they are."""
    out = {}
    for name in names:
        value = params[name]
        out[name] = value if isinstance(value, QArray) or is_prepared(value) else jnp.asarray(np.asarray(value))
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


def add_observed(observed: dict[str, list[Any]], name: str, value: Any) -> None:
    """Append one batch's observation of `name`; its SUMMED entries add into the first batch's."""
    entries = observed.setdefault(name, [])
    if not entries or not isinstance(value, dict) or not any(k in value for k in SUMMED):
        entries.append(value)
        return
    first = entries[0]
    for key in SUMMED:
        if key in value:
            first[key] = first[key] + value[key]
    rest = {k: v for k, v in value.items() if k not in SUMMED}
    if rest:
        entries.append(rest)


def layer_signature(model, i: int) -> Hashable:
    """What, besides its weights' shapes, decides layer i's program (the family's `layer_signature(i)`).

    Layers with equal signatures run one compiled program. A family without the
    method gives every layer a program of its own.
    """
    method = getattr(model, "layer_signature", None)
    return ("layer", i) if method is None else method(i)


class LayerPrograms:
    """Which layer's trace each layer reuses, and the name mapping between the two.

    The program of a signature is traced once, with the first layer of that
    signature (its representative) and that layer's names; another layer runs
    it on its own weights, handed in under the representative's names, and what
    the trace observed is renamed back outside the jit.
    """

    def __init__(self, model, share: bool):
        self.model = model
        self.share = share and hasattr(model, "layer_prefix")
        self.representatives: dict[Hashable, int] = {}

    def representative(self, i: int) -> int:
        if not self.share:
            return i
        rep = self.representatives.setdefault(layer_signature(self.model, i), i)
        if rep != i:
            names = sorted(self.rename(n, i, rep) for n in self.model.layer_tensor_names(i))
            if names != sorted(self.model.layer_tensor_names(rep)):
                return i  # the layers differ in more than the index in their names: a program of its own
        return rep

    def rename(self, name: str, src: int, dst: int) -> str:
        """`name` of layer `src` as layer `dst` calls it."""
        if src == dst:
            return name
        a, b = f"{self.model.layer_prefix(src)}.", f"{self.model.layer_prefix(dst)}."
        return b + name[len(a):] if name.startswith(a) else name


def _data_mesh(devices) -> Mesh | None:
    devices = list(devices or ())
    return Mesh(np.asarray(devices), ("data",)) if len(devices) > 1 else None


def iterate_layers(model, params: Mapping, input_ids, attention_mask=None, *,
                   linear: LinearHook = dense_linear,
                   grouped_linear: GroupedLinearHook = dense_grouped_linear,
                   observe: Observer | None = None, batch_size: int | None = None,
                   jit: bool = True, share_programs: bool | None = None,
                   devices: Sequence[jax.Device] | None = None,
                   replace: Callable[[int], Mapping[str, Any] | None] | None = None) -> Iterator[LayerResult]:
    """Embed `input_ids` [N, T], then yield each layer's LayerResult in order, reading layer i's weights only
    when the caller asks for layer i.

    All N samples' hidden states pass from layer to layer on the device, `batch_size` samples at a time (all
    at once when None), which bounds the attention scores' memory. With `jit`, the hooks must be traceable.
    share_programs: layers of equal `layer_signature` run one program, traced with the first of them, whose
    module names the hooks and `observe` then see (default: on with the float hooks, which ignore names).
    devices: with more than one, the batches are split across them (_LayerRunner). replace(i): once the
    caller is done with layer i, tensors that take the place of its own; the layer runs again on them to give
    the next its input (GPTQ's sequential mode: layer i calibrated on layers 0..i-1 as quantized).
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    n, t = input_ids.shape
    mask = jnp.ones((n, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if share_programs is None:
        share_programs = linear is dense_linear and grouped_linear is dense_grouped_linear
    runner = _LayerRunner(model, linear, grouped_linear, observe or (lambda name, x, valid: None), jit,
                          LayerPrograms(model, share_programs and jit), _data_mesh(devices) if jit else None,
                          n if batch_size is None else max(1, int(batch_size)), n)
    hidden = runner.embed(params, input_ids, mask)
    for i in range(model.num_layers):
        layer_params = runner.read_layer(params, i)
        layer_input = hidden if replace is not None else None  # kept only to run the layer again
        hidden, observed = runner.forward(i, layer_params, hidden, mask)
        result = LayerResult(i, hidden, observed)
        yield result
        new = replace(i) if replace is not None else None
        if new:
            hidden = result.hidden = runner.rerun(i, layer_params, new, layer_input, mask)
        del layer_params, layer_input


class _LayerRunner:
    """One calibration pass's compiled layer programs and how the samples go through them.

    With a Mesh (more than one device), the batches are split across the
    devices (one `data` axis): each device runs whole batches of `batch_size`
    samples, the same program as one device would, with the weights
    replicated; what `observe` returns is gathered, one entry per batch, in
    sample order, as on one device. Batches left over (fewer than one per
    device) run on the first device.
    """

    def __init__(self, model, linear, grouped_linear, observe: Observer, jit: bool, programs: LayerPrograms,
                 mesh: Mesh | None, batch_size: int, samples: int):
        self.model, self.programs, self.mesh, self.batch_size, self.jit = model, programs, mesh, batch_size, jit

        def run_layer(i, layer_params, hidden, mask):
            sink: dict[str, Any] = {}
            hooks = _observing_hooks(linear, grouped_linear, observe, mask > 0, sink)
            return model.layer(i, layer_params, hidden, mask, *hooks), sink

        def run_plain(i, layer_params, hidden, mask):
            return model.layer(i, layer_params, hidden, mask, linear, grouped_linear)

        self.step = jax.jit(run_layer, static_argnums=0) if jit else run_layer
        self.plain_step = jax.jit(run_plain, static_argnums=0) if jit else run_plain
        self.sharded_step = _sharded_step(run_layer, mesh) if mesh is not None else None
        self.sharded_plain = _sharded_step(run_plain, mesh, observes=False) if mesh is not None else None
        self.group = batch_size * (mesh.size if mesh is not None else 1)
        self.split = samples - samples % self.group if mesh is not None and samples >= self.group else 0

    def embed(self, params: Mapping, input_ids: jax.Array, mask: jax.Array) -> jax.Array:
        """The embedded samples [N, T, hidden], `batch_size` at a time."""
        embed = jax.jit(self.model.embed) if self.jit else self.model.embed
        embed_params = read_tensors(params, self.model.embed_tensor_names())
        b = self.batch_size
        return jnp.concatenate([embed(embed_params, input_ids[s:s + b], mask[s:s + b])
                                for s in range(0, input_ids.shape[0], b)])

    def read_layer(self, params: Mapping, i: int) -> dict[str, Any]:
        """Layer i's tensors under the names its program was traced with."""
        rep = self.programs.representative(i)
        return {self.programs.rename(name, i, rep): value
                for name, value in read_tensors(params, self.model.layer_tensor_names(i)).items()}

    def forward(self, i: int, layer_params, hidden: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, dict[str, list[Any]]]:
        """Layer i over every sample: its output and what `observe` returned, one entry per batch."""
        rep, group, b = self.programs.representative(i), self.group, self.batch_size
        outs, observed, sinks = [], {}, []
        running = None  # the SUMMED entries' sums so far, folded on the devices (_sharded_step)
        for s in range(0, self.split, group):  # whole groups: one batch per device
            out, sink, running = self.sharded_step(rep, layer_params, hidden[s:s + group], mask[s:s + group],
                                                   running)
            outs.append(out)
            sinks.append(sink)
            _bound_in_flight(outs)
        # One transfer for all groups, once they are all dispatched; then one entry per batch.
        outs, sinks, totals = _gathered(outs), _to_host(sinks), _to_host(running)
        for sink in sinks:
            for name, value in sink.items():
                for d in range(self.mesh.size):
                    add_observed(observed, self.programs.rename(name, rep, i),
                                 jax.tree.map(lambda a, d=d: a[d], value))
        for name, sums in (totals or {}).items():  # the groups' sums, as the first batch's entry holds them
            first = observed[self.programs.rename(name, rep, i)][0]
            first.update({key: _unfolded(value) for key, value in sums.items()})
        for s in range(self.split, hidden.shape[0], b):  # the rest: on this process's first device
            out, sink = self.step(rep, layer_params, hidden[s:s + b], mask[s:s + b])
            outs.append(out)
            _bound_in_flight(outs)
            for name, value in sink.items():
                add_observed(observed, self.programs.rename(name, rep, i), value)
        return (jnp.concatenate(outs) if len(outs) > 1 else outs[0]), observed

    def rerun(self, i: int, layer_params: dict, new: Mapping[str, Any], hidden: jax.Array,
              mask: jax.Array) -> jax.Array:
        """Layer i's output over every sample again with `new` tensors in place of its own, the batches split
        over the devices as in `forward`."""
        rep, group, b = self.programs.representative(i), self.group, self.batch_size
        layer_params.update({self.programs.rename(name, i, rep): jnp.asarray(value) for name, value in new.items()})
        outs = []
        for s in range(0, self.split, group):
            outs.append(self.sharded_plain(rep, layer_params, hidden[s:s + group], mask[s:s + group]))
            _bound_in_flight(outs)
        outs = _gathered(outs)
        for s in range(self.split, hidden.shape[0], b):
            outs.append(self.plain_step(rep, layer_params, hidden[s:s + b], mask[s:s + b]))
            _bound_in_flight(outs)
        return jnp.concatenate(outs) if len(outs) > 1 else outs[0]


def _gathered(outs: list) -> list:
    """Outputs of the sharded steps as arrays of this process: as they are with one process; with several,
    every process gathers every device's rows (each process runs the next layer's batches from them)."""
    if not outs or jax.process_count() == 1:
        return outs
    from jax.experimental import multihost_utils

    return [jnp.asarray(a) for a in multihost_utils.process_allgather(outs, tiled=True)]


def _to_host(tree):
    """A pytree of the sharded steps' results as numpy arrays: every device's, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _bound_in_flight(outs: list) -> None:
    """Wait for the batch before the last: dispatch runs ahead of the device, and every batch
    in flight holds its own activations, so at most two are (calib_memory counts two)."""
    if len(outs) >= 2 and isinstance(outs[-2], jax.Array):
        outs[-2].block_until_ready()


def _sharded_step(run_layer, mesh: Mesh, observes: bool = True):
    """run_layer over a [devices * batch] group: each device runs its own batch, weights replicated. The mesh may
    span several processes (each then hands in the same group; the results are sharded over all devices).

    Observing, it returns (output, what `observe` returned less its SUMMED entries, one leading entry per device,
    and `running`: those entries' sums over every batch so far, this group's added on the devices). A sum is
    folded in batch order (_ordered_fold), so it holds the very floats one device's running sum holds, and only
    one sum, sharded by rows over the devices, moves; not one [in, in] matrix per batch to every host.
    """
    data, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    devices = mesh.size

    @functools.partial(jax.jit, static_argnums=0)
    def step(i, layer_params, hidden, mask, running):
        def local(layer_params, hidden, mask, running):
            if not observes:
                return run_layer(i, layer_params, hidden, mask)
            out, sink = run_layer(i, layer_params, hidden, mask)
            sums = {name: {k: value[k] for k in SUMMED if k in value} for name, value in sink.items()
                    if isinstance(value, dict) and any(k in value for k in SUMMED)}
            rest = {name: ({k: v for k, v in value.items() if k not in SUMMED} if name in sums else value)
                    for name, value in sink.items()}
            folded = {name: {k: _ordered_fold(v, None if running is None else running[name][k], devices)
                             for k, v in entries.items()} for name, entries in sums.items()}
            # One leading entry per device: gathered along the data axis.
            return out, jax.tree.map(lambda a: a[None], rest), folded

        out_specs = (P("data"), P("data"), P("data")) if observes else P("data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                             out_specs=out_specs, check_vma=False)(layer_params, hidden, mask, running)

    def run(i, layer_params, hidden, mask, running=None):
        if jax.process_count() > 1:  # arrays of this process become the global ones through the host
            layer_params, hidden, mask = jax.tree.map(np.asarray, (layer_params, hidden, mask))
        layer_params = jax.device_put(layer_params, replicated)
        return step(i, layer_params, jax.device_put(hidden, data), jax.device_put(mask, data), running)

    return run


def _ordered_fold(value: jax.Array, running: jax.Array | None, devices: int) -> jax.Array:
    """Inside shard_map over `data`: this group's values (one batch per device, device order = batch order) added
    to the running sum in batch order, as add_observed adds them on one device: ((running + v_0) + v_1) + ...
    (v_0 + v_1 + ... in the first group). Each device folds one block of rows of every device's value (an
    all-to-all: each sends and receives about one value's bytes) and keeps that block of the sum: [rows / devices
    rounded up, in], the last block padded. A scalar (a count) is all-gathered and held whole: [1] per device.
    `running` is this function's earlier result."""
    if value.ndim == 0:
        return _in_batch_order(jax.lax.all_gather(value, "data"), None if running is None else running[0])[None]
    if value.ndim != 2 or value.shape[0] != value.shape[1]:
        raise ValueError(f"a summed observation is a scalar or a square matrix, not {value.shape}")
    rows, width = value.shape
    block = -(-rows // devices)
    padded = jnp.pad(value, [(0, block * devices - rows), (0, 0)])
    parts = jax.lax.all_to_all(padded, "data", 0, 0, tiled=True).reshape(devices, block, width)
    return _in_batch_order(parts, running)


def _in_batch_order(parts: jax.Array, running: jax.Array | None) -> jax.Array:
    """((running + parts[0]) + parts[1]) + ...; parts[0] + parts[1] + ... without a running sum."""
    total = parts[0] if running is None else running + parts[0]
    for j in range(1, parts.shape[0]):
        total = total + parts[j]
    return total


def _unfolded(value: np.ndarray) -> np.ndarray:
    """A sum _ordered_fold left over the devices, gathered: the array as one device's sum holds it (a scalar's
    copies, one per device, are one; a square matrix's padded rows go)."""
    return value[0] if value.ndim == 1 else value[:value.shape[1]]


def forward_layerwise(model, params: Mapping, input_ids, attention_mask=None, *,
                      linear: LinearHook = dense_linear,
                      grouped_linear: GroupedLinearHook = dense_grouped_linear,
                      batch_size: int | None = None, jit: bool = True,
                      on_layer: Callable[[int], None] | None = None) -> jax.Array:
    """model.forward computed layer by layer from lazily read weights (same result); `on_layer(i)` after
    layer i (progress)."""
    hidden = None
    for result in iterate_layers(model, params, input_ids, attention_mask, linear=linear,
                                 grouped_linear=grouped_linear, batch_size=batch_size, jit=jit):
        hidden = result.hidden
        if on_layer is not None:
            on_layer(result.index)
    if hidden is None:
        hidden = model.embed(read_tensors(params, model.embed_tensor_names()), input_ids, attention_mask)
    head_params = read_tensors(params, model.head_tensor_names())
    mask = None if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)

    def head(head_params, hidden, mask):
        return model.head(head_params, hidden, mask, linear)

    return (jax.jit(head) if jit else head)(head_params, hidden, mask)
