"""Run a model one layer at a time from lazily read weights, observing every linear's input.

Only one layer's weights are alive at once: layer i's tensors are read from the
params Mapping just before the layer runs and dropped after, so a model larger
than memory can be calibrated. Layers run jit-compiled, one program per layer
signature (the family's `layer_signature(i)`: e.g. sliding-window against global
attention), not per layer: names are mapped outside the trace. What the caller
wants to know about a linear's input comes out of the compiled layer as a
functional output of `observe`, so nothing leaks out of the trace. With several
devices the batches are split across them (data parallel); a MoE layer's experts
can also be split across them (expert parallel: _expert_parallel_step).
"""

from __future__ import annotations

import dataclasses
import functools
import re
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
                   replace: Callable[[int], Mapping[str, Any] | None] | None = None,
                   shard_experts: bool = False) -> Iterator[LayerResult]:
    """Embed `input_ids` [N, T], then yield each layer's LayerResult in order, reading layer i's weights only
    when the caller asks for layer i.

    All N samples' hidden states pass from layer to layer on the device, `batch_size` samples at a time (all
    at once when None), which bounds the attention scores' memory. With `jit`, the hooks must be traceable.
    share_programs: layers of equal `layer_signature` run one program, traced with the first of them, whose
    module names the hooks and `observe` then see (default: on with the float hooks, which ignore names).
    devices: with more than one, the batches are split across them (_LayerRunner). replace(i): once the
    caller is done with layer i, tensors that take the place of its own; the layer runs again on them to give
    the next its input (GPTQ's sequential mode: layer i calibrated on layers 0..i-1 as quantized).
    shard_experts: with more than one device, each MoE layer's experts are split across them, each device
    holding ceil(E / devices) whole experts and their Hessians (_expert_parallel_step); other layers as without.
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    n, t = input_ids.shape
    mask = jnp.ones((n, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if share_programs is None:
        share_programs = linear is dense_linear and grouped_linear is dense_grouped_linear
    runner = _LayerRunner(model, linear, grouped_linear, observe or (lambda name, x, valid: None), jit,
                          LayerPrograms(model, share_programs and jit), _data_mesh(devices) if jit else None,
                          n if batch_size is None else max(1, int(batch_size)), n, shard_experts)
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
                 mesh: Mesh | None, batch_size: int, samples: int, shard_experts: bool = False):
        self.model, self.programs, self.mesh, self.batch_size, self.jit = model, programs, mesh, batch_size, jit
        # Expert parallel: MoE layers' experts split over the mesh (each device its own whole experts).
        self.expert_step = self.expert_plain = None
        if mesh is not None and shard_experts:
            self.expert_step = _expert_parallel_step(model, linear, grouped_linear, observe, mesh)
            self.expert_plain = _expert_parallel_step(model, linear, grouped_linear, observe, mesh, observes=False)

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
        """Layer i's tensors under the names its program was traced with. Experts to be split over the devices
        stay on the host (numpy) until each device is handed its own."""
        rep = self.programs.representative(i)
        names = self.model.layer_tensor_names(i)
        host = {name for names_ in expert_stacks(names).values() for name in names_} if self.expert_step else ()
        tensors = read_tensors(params, [name for name in names if name not in host])
        tensors.update({name: np.asarray(params[name]) for name in names if name in host})
        return {self.programs.rename(name, i, rep): tensors[name] for name in names}

    def forward(self, i: int, layer_params, hidden: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, dict[str, list[Any]]]:
        """Layer i over every sample: its output and what `observe` returned, one entry per batch."""
        rep, group, b = self.programs.representative(i), self.group, self.batch_size
        if self.expert_step is not None and expert_stacks(layer_params):
            return self._expert_parallel(i, rep, layer_params, hidden, mask)
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
            self._add_entries(observed, sink, self.mesh.size, rep, i)
        self._add_sums(observed, {name: {key: _unfolded(value) for key, value in sums.items()}
                                  for name, sums in (totals or {}).items()}, rep, i)
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
        if self.expert_step is not None and expert_stacks(layer_params):
            layer_params.update({self.programs.rename(name, i, rep): np.asarray(value) for name, value in new.items()})
            return self._expert_parallel(i, rep, layer_params, hidden, mask, observes=False)
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

    def _expert_parallel(self, i: int, rep: int, layer_params: dict, hidden: jax.Array, mask: jax.Array, *,
                         observes: bool = True):
        """`forward` (or, not observing, `rerun`'s output) of a MoE layer whose experts are split over the
        devices: whole groups of one batch a device, then each batch left over on every device at once (its
        experts are everywhere but nowhere whole), in batch order."""
        step = self.expert_step if observes else self.expert_plain
        placed = place_experts(layer_params, self.mesh)
        b, devices = self.batch_size, self.mesh.size
        n = hidden.shape[0]
        whole = n - n % self.group
        spans = [(s, s + self.group, devices) for s in range(0, whole, self.group)]
        spans += [(s, min(s + b, n), 1) for s in range(whole, n, b)]
        outs, sinks, running = [], [], None
        for start, stop, copies in spans:
            result = step(rep, copies, placed, hidden[start:stop], mask[start:stop], running)
            if not observes:
                outs.append(result)
            else:
                out, sink, running = result
                outs.append(out)
                sinks.append(sink)
            _bound_in_flight(outs)
        outs = _gathered(outs)
        hidden_out = jnp.concatenate([jnp.asarray(o) for o in outs]) if len(outs) > 1 else jnp.asarray(outs[0])
        if not observes:
            return hidden_out
        observed: dict[str, list[Any]] = {}
        for (_, _, copies), sink in zip(spans, _to_host(sinks)):
            self._add_entries(observed, sink, copies, rep, i)
        dense, owned = _to_host(running)
        self._add_sums(observed, {name: {key: _unfolded(value) for key, value in sums.items()}
                                  for name, sums in dense.items()}, rep, i)
        self._add_sums(observed, {name: {k: value[e] for k, value in sums.items()}
                                  for key, sums in owned.items() for e, name in enumerate(placed.modules[key])},
                       rep, i)
        return hidden_out, observed

    def _add_entries(self, observed: dict[str, list[Any]], sink: dict, copies: int, rep: int, i: int) -> None:
        """One sharded step's observations, under layer i's names: with `copies` > 1, one leading entry per
        device (one batch each, in batch order); with 1, the one batch every device ran."""
        for name, value in sink.items():
            for d in range(copies):
                add_observed(observed, self.programs.rename(name, rep, i),
                             jax.tree.map(lambda a, d=d: a[d], value) if copies > 1 else value)

    def _add_sums(self, observed: dict[str, list[Any]], sums: dict[str, dict], rep: int, i: int) -> None:
        """The SUMMED entries summed on the devices, as one device's first batch entry holds them."""
        for name, entries in sums.items():
            observed[self.programs.rename(name, rep, i)][0].update(entries)


_EXPERT_WEIGHT = re.compile(r"^(|.*\.)experts\.(\d+)\.(.+)\.weight$")


def expert_stacks(names) -> dict[str, list[str]]:
    """The expert weights among tensor `names`, a list per projection in expert order: `...experts.*.proj.weight`
    -> [`...experts.0.proj.weight`, `...experts.1.proj.weight`, ...] (every index from 0, or none of them)."""
    found: dict[str, dict[int, str]] = {}
    for name in names:
        match = _EXPERT_WEIGHT.match(name)
        if match:
            found.setdefault(_stack_key(name), {})[int(match[2])] = name
    return {key: [by_index[e] for e in range(len(by_index))] for key, by_index in found.items()
            if sorted(by_index) == list(range(len(by_index)))}


def _stack_key(weight: str) -> str:
    """The stack an expert weight's name belongs to (its expert index as `*`); "" for any other name."""
    match = _EXPERT_WEIGHT.match(weight)
    return f"{match[1]}experts.*.{match[3]}.weight" if match else ""


class _ExpertSlots(dict):
    """A layer's tensors inside an expert-parallel program: the experts' weights are not among them (the grouped
    hook reads this device's own from their stack), so reading one gives None."""

    def __init__(self, tensors, experts: frozenset):
        super().__init__(tensors)
        self.experts = experts

    def __missing__(self, name):
        if name in self.experts:
            return None
        raise KeyError(name)


@dataclasses.dataclass
class _PlacedLayer:
    """A MoE layer's tensors on the mesh: the dense ones replicated, each projection's experts stacked
    [devices * per, out, in] (zero experts at the end) and split, `per` whole experts a device."""

    dense: dict[str, jax.Array]
    stacks: dict[str, jax.Array]
    modules: dict[str, tuple[str, ...]]   # stack key -> the experts' module names, expert order
    layout: tuple                           # (stack key, experts) pairs: what the program is traced for


def _expert_parallel_step(model, linear, grouped_linear, observe: Observer, mesh: Mesh, observes: bool = True):
    """A MoE layer over the mesh with its experts split, not copied: device d holds experts [d * per, (d + 1) *
    per) of each projection (per = ceil(E / devices)) and their input Hessians.

    step(i, copies, placed, hidden, mask, running): with copies = devices, each device runs its own batch of the
    group as `_sharded_step` does; with copies = 1, every device runs the same batch (one left over). Every
    layer but the experts runs as in data parallel; a grouped linear gathers every batch's rows to every device,
    which multiplies the rows routed to its own experts (ragged_dot over them, shifted to the first row) and
    sums its rows into each batch's owner (a reduce-scatter: each row comes from one device, the others add
    zeros). The owner of an expert sums its Hessian over the batches in batch order, as one device does (the
    same products, bit for bit). The experts' outputs are those of a ragged_dot over fewer experts, whose float
    additions may round otherwise than one over all of them: the layer's output may differ by float32 rounding
    from one device's (README: "The same bytes whatever the mesh").

    Observing, it returns (output, what `observe` returned less its SUMMED entries (one leading entry per device
    with copies = devices), running): running = (the dense linears' sums, folded as _sharded_step folds them;
    the experts' sums: stack key -> {key: [devices * per, ...]}, each device its own experts')."""
    devices = mesh.size
    split, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def program(i, copies, layout, dense, stacks, hidden, mask, running):
        modules = dict(layout)
        experts = frozenset(f"{name}.weight" for names in modules.values() for name in names)

        def local(dense, stacks, hidden, mask, running):
            sink, owned = {}, {}
            valid = mask > 0
            device = jax.lax.axis_index("data")
            hooks = _observing_hooks(linear, grouped_linear, observe, valid, sink) if observes else (linear, None)

            def grouped(names, x, weights, group_sizes):
                key = _stack_key(f"{names[0]}.weight")
                w = stacks[key]  # [per, out, in]: this device's experts
                per = w.shape[0]
                if observes:  # this device's own batch, every expert: all but the sums
                    ends, rows = jnp.cumsum(group_sizes), jnp.arange(x.shape[0])
                    for e, name in enumerate(names):
                        value = observe(name, x, (rows >= ends[e] - group_sizes[e]) & (rows < ends[e]))
                        sink[name] = ({k: v for k, v in value.items() if k not in SUMMED}
                                      if isinstance(value, dict) else value)
                if copies > 1:
                    xs, sizes = jax.lax.all_gather(x, "data"), jax.lax.all_gather(group_sizes, "data")
                else:
                    xs, sizes = x[None], group_sizes[None]
                first = device * per
                ys = jnp.stack([_own_experts_rows(grouped_linear, names, xs[j], w, sizes[j], first, devices)
                                for j in range(copies)])
                if observes:
                    sums = _own_experts_sums(observe, names, xs, sizes, first, per,
                                             None if running is None else running[1].get(key))
                    if sums:
                        owned[key] = sums
                if copies > 1:
                    return jax.lax.psum_scatter(ys, "data", scatter_dimension=0, tiled=True)[0]
                return jax.lax.psum(ys[0], "data")

            out = model.layer(i, _ExpertSlots(dense, experts), hidden, mask, hooks[0], grouped)
            if not observes:
                return out
            sums = {name: {k: value[k] for k in SUMMED if k in value} for name, value in sink.items()
                    if isinstance(value, dict) and any(k in value for k in SUMMED)}
            rest = {name: ({k: v for k, v in value.items() if k not in SUMMED} if name in sums else value)
                    for name, value in sink.items()}
            fold = _ordered_fold if copies > 1 else _replicated_fold
            folded = {name: {k: fold(v, None if running is None else running[0][name][k], devices)
                             for k, v in entries.items()} for name, entries in sums.items()}
            if copies > 1:
                rest = jax.tree.map(lambda a: a[None], rest)
            return out, rest, (folded, owned)

        batch = P("data") if copies > 1 else P()
        out_specs = (batch, batch, P("data")) if observes else batch
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), batch, batch, P("data")),
                             out_specs=out_specs, check_vma=False)(dense, stacks, hidden, mask, running)

    def run(i, copies, placed: _PlacedLayer, hidden, mask, running=None):
        where = split if copies > 1 else replicated
        if jax.process_count() > 1:
            hidden, mask = np.asarray(hidden), np.asarray(mask)
        return program(i, copies, placed.layout, placed.dense, placed.stacks, jax.device_put(hidden, where),
                       jax.device_put(mask, where), running)

    return run


def place_experts(layer_params: Mapping[str, Any], mesh: Mesh) -> _PlacedLayer:
    """A MoE layer's tensors (numpy, or arrays of this process) placed for _expert_parallel_step: the experts of
    each projection stacked on the host and split over the mesh, the rest replicated."""
    devices = mesh.size
    split, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    stacked = expert_stacks(layer_params)
    in_stacks = {name for names in stacked.values() for name in names}
    dense = {name: value for name, value in layer_params.items() if name not in in_stacks}
    if jax.process_count() > 1:
        dense = jax.tree.map(np.asarray, dense)
    stacks = {}
    for key, names in stacked.items():
        per = -(-len(names) // devices)
        first = np.asarray(layer_params[names[0]])
        whole = np.zeros((per * devices,) + first.shape, first.dtype)
        for e, name in enumerate(names):
            whole[e] = np.asarray(layer_params[name])
        stacks[key] = jax.device_put(whole, split)
    modules = {key: tuple(name[:-len(".weight")] for name in names) for key, names in stacked.items()}
    return _PlacedLayer(jax.device_put(dense, replicated), stacks, modules, tuple(sorted(modules.items())))


def _own_experts_rows(grouped_linear, names, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                      first: jax.Array, devices: int) -> jax.Array:
    """Rows of x [M, in] (sorted by expert, group_sizes [E]) routed to experts [first, first + per), times their
    weights w [per, out, in] (experts past E: none of the rows); every other row 0."""
    per, experts = w.shape[0], group_sizes.shape[0]
    padded = jnp.pad(group_sizes, (0, max(0, per * devices - experts)))
    sizes = jax.lax.dynamic_slice(padded, (first,), (per,))
    start = jnp.sum(jnp.where(jnp.arange(experts) < first, group_sizes, 0))
    count = jnp.sum(sizes)
    y = grouped_linear(list(names[:per]), jnp.roll(x, -start, axis=0), [w[k] for k in range(per)], sizes)
    rows = jnp.arange(x.shape[0])
    return jnp.where(((rows >= start) & (rows < start + count))[:, None], jnp.roll(y, start, axis=0), 0.0)


def _own_experts_sums(observe: Observer, names, xs: jax.Array, sizes: jax.Array, first: jax.Array,
                      per: int, running) -> dict[str, jax.Array]:
    """The SUMMED entries of `observe` for experts [first, first + per) over the batches xs [copies, M, in] in
    order, added to `running` ({key: [per, ...]}): each the very sum one device makes of its batches (an
    expert's rows picked by the same mask, the same products). Experts past the last give zeros; {} when the
    observer sums nothing for these experts (the observer treats every expert of a grouped call alike)."""
    experts, rows = len(names), jnp.arange(xs.shape[1])
    stacked = []
    for k in range(per):
        e = first + k
        index = jnp.minimum(e, experts - 1)
        total = None if running is None else {key: value[k] for key, value in running.items()}
        for j in range(xs.shape[0]):
            ends = jnp.cumsum(sizes[j])
            valid = (rows >= ends[index] - sizes[j][index]) & (rows < ends[index]) & (e < experts)
            value = observe(names[0], xs[j], valid)
            value = {key: value[key] for key in SUMMED if isinstance(value, dict) and key in value}
            if not value:
                return {}
            total = value if total is None else {key: total[key] + value[key] for key in value}
        stacked.append(total)
    return {key: jnp.stack([t[key] for t in stacked]) for key in stacked[0]}


def _replicated_fold(value: jax.Array, running: jax.Array | None, devices: int) -> jax.Array:
    """_ordered_fold's result for a batch every device ran (each holds the same value): this device's block of
    it added to its block of the running sum."""
    if value.ndim == 0:
        return (value if running is None else running[0] + value)[None]
    rows, width = value.shape
    block = -(-rows // devices)
    padded = jnp.pad(value, [(0, block * devices - rows), (0, 0)])
    mine = jax.lax.dynamic_slice(padded, (jax.lax.axis_index("data") * block, 0), (block, width))
    return mine if running is None else running + mine


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
