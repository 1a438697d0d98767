"""The expert-parallel program: a MoE layer's experts split over the devices, whole experts a device.

Each projection's E experts are stacked on the host and split over the mesh's `data` axis (place_experts);
every batch's routed rows are gathered to every device, which multiplies the rows routed to its own experts
and sums its rows back to each batch's owner; each expert's summed statistics are added by its owner, in
batch order (the same products one device makes, bit for bit).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qconvert.calibration.device_sums import fold_sums, ordered_fold, replicated_fold, split_sink, split_summed
from qconvert.calibration.layer_hooks import Observer, attention_observer, observe_experts, observing_hooks
from qconvert.models.hooks import kv_tap


_EXPERT_WEIGHT = re.compile(r"^(|.*\.)experts\.([0-9]+)\.(.+)\.weight$")


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


def expert_parallel_step(model, linear, grouped_linear, observe: Observer, mesh: Mesh, observes: bool = True):
    """A MoE layer over the mesh with its experts split, not copied: device d holds experts [d * per, (d + 1) *
    per) of each projection (per = ceil(E / devices)) and their input Hessians.

    step(i, copies, placed, hidden, mask, running): with copies = devices, each device runs its own batch of the
    group as data_parallel.sharded_step does; with copies = 1, every device runs the same batch (one left
    over). Every layer but the experts runs as in data parallel (_layer_on_device). The experts' outputs are
    those of a ragged_dot over fewer experts, whose float additions may round otherwise than one over all of
    them: the layer's output may differ by float32 rounding from one device's (README: "The same bytes whatever
    the mesh").

    Observing, it returns (output, what `observe` returned less its summed entries (one leading entry per device
    with copies = devices), running): running = (the dense linears' sums, folded as data_parallel.sharded_step
    folds them; the experts' sums: stack key -> {key: [devices * per, ...]}, each device its own experts')."""
    devices = mesh.size
    split, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    hooks = (linear, grouped_linear, observe if observes else None)

    @functools.partial(jax.jit, static_argnums=(0, 1, 2))
    def program(i, copies, layout, dense, stacks, hidden, mask, running):
        experts = frozenset(f"{name}.weight" for names in dict(layout).values() for name in names)
        local = functools.partial(_layer_on_device, model, hooks, i, copies, devices, experts)
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


def _layer_on_device(model, hooks, i: int, copies: int, devices: int, experts: frozenset, dense, stacks, hidden,
                     mask, running):
    """Inside shard_map: layer i on this device's batch (or the one every device runs), its experts through
    _grouped_by_owner; observing (hooks' observer not None), also what it observed and the sums so far."""
    linear, grouped_linear, observe = hooks
    sink, owned = {}, {}
    valid = mask > 0
    observed = observing_hooks(linear, grouped_linear, observe, valid, sink) if observe else (linear, None)
    grouped = _grouped_by_owner(grouped_linear, observe, stacks, copies, devices,
                                None if running is None else running[1], sink, owned)
    with kv_tap(attention_observer(observe, valid, sink) if observe else None):
        out = model.layer(i, _ExpertSlots(dense, experts), hidden, mask, observed[0], grouped)
    if observe is None:
        return out
    sums, rest = split_sink(sink)
    folded = fold_sums(sums, None if running is None else running[0],
                       ordered_fold if copies > 1 else replicated_fold, devices)
    if copies > 1:
        rest = jax.tree.map(lambda a: a[None], rest)
    return out, rest, (folded, owned)


def _grouped_by_owner(grouped_linear, observe: Observer | None, stacks: Mapping[str, jax.Array], copies: int,
                      devices: int, running: Mapping | None, sink: dict, owned: dict):
    """The grouped hook inside the expert-parallel program: every batch's rows gathered, each device
    multiplying those routed to its own experts (`stacks`: [per, out, in] a projection) and summing its rows
    back to each batch's owner. Observing, each expert's summed entries go to `owned` (added to `running`),
    the rest of this device's own batch's observations to `sink`."""

    def grouped(names, x, weights, group_sizes):
        key = _stack_key(f"{names[0]}.weight")
        w = stacks[key]  # [per, out, in]: this device's experts
        per = w.shape[0]
        if copies > 1:
            xs, sizes = jax.lax.all_gather(x, "data"), jax.lax.all_gather(group_sizes, "data")
        else:
            xs, sizes = x[None], group_sizes[None]
        first = jax.lax.axis_index("data") * per
        ys = jnp.stack([own_experts_rows(grouped_linear, names, xs[j], w, sizes[j], first, devices)
                        for j in range(copies)])
        if observe is not None:
            sums = _own_experts_sums(observe, names, xs, sizes, first, per,
                                     None if running is None else running.get(key))
            if sums:
                owned[key] = sums
        if copies > 1:
            y = jax.lax.psum_scatter(ys, "data", scatter_dimension=0, tiled=True)[0]
        else:
            y = jax.lax.psum(ys[0], "data")
        if observe is not None:  # this device's own batch, every expert: all but the sums
            observe_experts(observe, names, x, y, group_sizes, sink, listed_only=True)
        return y

    return grouped


def place_experts(layer_params: Mapping[str, Any], mesh: Mesh) -> _PlacedLayer:
    """A MoE layer's tensors (numpy, or arrays of this process) placed for expert_parallel_step: the experts of
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


def own_experts_rows(grouped_linear, names, x: jax.Array, w: jax.Array, group_sizes: jax.Array,
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
    """The summed entries of `observe` for experts [first, first + per) over the batches xs [copies, M, in] in
    order, added to `running` ({key: [per, ...]}): each the very sum one device makes of its batches (an
    expert's rows picked by the same mask, the same products). Experts past the last give zeros; {} when the
    observer sums nothing for these experts (the observer treats every expert of a grouped call alike)."""
    experts, rows = len(names), jnp.arange(xs.shape[1])
    stacked = []
    for k in range(per):
        e = first + k
        index = jnp.minimum(e, experts - 1)
        total = None if running is None else jax.tree.map(lambda value, k=k: value[k], running)
        for j in range(xs.shape[0]):
            ends = jnp.cumsum(sizes[j])
            valid = (rows >= ends[index] - sizes[j][index]) & (rows < ends[index]) & (e < experts)
            value = split_summed(observe(names[0], xs[j], valid))[1]
            if not value:
                return {}
            total = value if total is None else jax.tree.map(lambda a, b: a + b, total, value)
        stacked.append(total)
    return jax.tree.map(lambda *per_expert: jnp.stack(per_expert), *stacked)


