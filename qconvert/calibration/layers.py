"""Run a model one layer at a time from lazily read weights, observing what the calibration statistics ask for.

Only one layer's weights are alive at once: layer i's tensors are read from the
params Mapping just before the layer runs and dropped after, so a model larger
than memory can be calibrated. Layers run jit-compiled, one program per layer
signature (the family's `layer_signature(i)`: e.g. sliding-window against global
attention), not per layer: names are mapped outside the trace. What the caller
wants to know about a linear or an attention cache comes out of the compiled layer as a
functional output of `observe` (layer_hooks.py), so nothing leaks out of the trace. With several
devices the batches are split across them (data_parallel.py); a MoE layer's experts
can also be split across them (expert_parallel.py). Sums add in batch order (device_sums.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qconvert.calibration.data_parallel import bound_in_flight, gathered, sharded_step, to_host
from qconvert.calibration.device_sums import add_observed, add_sums, unfolded
from qconvert.calibration.expert_parallel import expert_parallel_step, expert_stacks, place_experts
from qconvert.calibration.layer_hooks import Observer, attention_observer, observing_hooks
from qconvert.formats import QArray
from qconvert.formats.qarray import is_prepared
from qconvert.models.hooks import GroupedLinearHook, KVTap, LinearHook, dense_grouped_linear, dense_linear, kv_tap


@dataclasses.dataclass
class LayerResult:
    """What one layer did for one batch of samples.

    `hidden` is replaced by the layer's output on its new weights when the caller's
    `replace` hands some in (sequential quantization).
    """

    index: int
    hidden: jax.Array               # the layer's output, float32 [B, T, H]
    observed: dict[str, list[Any]]  # module name -> observe(...) per micro-batch (summed entries: one sum)


def read_tensors(params: Mapping, names: Sequence[str]) -> dict[str, Any]:
    """Read `names` from a (possibly lazy) Mapping into jax arrays; QArrays (and prepared weights) stay as they are."""
    out = {}
    for name in names:
        value = params[name]
        out[name] = value if isinstance(value, QArray) or is_prepared(value) else jnp.asarray(np.asarray(value))
    return out


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


def iterate_layers(model, params: Mapping, input_ids, attention_mask=None, *, linear: LinearHook = dense_linear,
                   grouped_linear: GroupedLinearHook = dense_grouped_linear, observe: Observer | None = None,
                   batch_size: int | None = None, jit: bool = True, share_programs: bool | None = None,
                   devices: Sequence[jax.Device] | None = None,
                   replace: Callable[[int], Mapping[str, Any] | None] | None = None,
                   shard_experts: bool = False, kv_cache: KVTap | None = None) -> Iterator[LayerResult]:
    """Embed `input_ids` [N, T], then yield each layer's LayerResult in order, reading layer i's weights only
    when the caller asks for layer i.

    All N samples' hidden states pass from layer to layer on the device, `batch_size` samples at a time (all
    at once when None), which bounds the attention scores' memory. With `jit`, the hooks must be traceable.
    share_programs: layers of equal `layer_signature` run one program, traced with the first of them, whose
    module names the hooks and `observe` then see (default: on with the float hooks and no `kv_cache`, which
    ignore names).
    devices: with more than one, the batches are split across them (_LayerRunner). replace(i): once the
    caller is done with layer i, tensors that take the place of its own; the layer runs again on them to give
    the next its input (GPTQ's sequential mode: layer i calibrated on layers 0..i-1 as quantized).
    shard_experts: with more than one device, each MoE layer's experts are split across them, each device
    holding ceil(E / devices) whole experts and their Hessians (expert_parallel.py); other layers as without.
    kv_cache: a tap every attention block's keys and values pass through (models.hooks.cached_kv).
    """
    input_ids = jnp.asarray(input_ids, jnp.int32)
    n, t = input_ids.shape
    mask = jnp.ones((n, t), jnp.int32) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    if share_programs is None:
        share_programs = linear is dense_linear and grouped_linear is dense_grouped_linear and kv_cache is None
    runner = _LayerRunner(model, linear, grouped_linear, observe or (lambda name, x, valid: None), jit,
                          LayerPrograms(model, share_programs and jit), _data_mesh(devices) if jit else None,
                          n if batch_size is None else max(1, int(batch_size)), n, shard_experts, kv_cache)
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
                 mesh: Mesh | None, batch_size: int, samples: int, shard_experts: bool = False,
                 kv_cache: KVTap | None = None):
        self.model, self.programs, self.mesh, self.batch_size, self.jit = model, programs, mesh, batch_size, jit
        # Expert parallel: MoE layers' experts split over the mesh (each device its own whole experts).
        self.expert_step = self.expert_plain = None
        if mesh is not None and shard_experts:
            self.expert_step = expert_parallel_step(model, linear, grouped_linear, observe, mesh)
            self.expert_plain = expert_parallel_step(model, linear, grouped_linear, observe, mesh, observes=False)

        def run_layer(i, layer_params, hidden, mask):
            sink: dict[str, Any] = {}
            hooks = observing_hooks(linear, grouped_linear, observe, mask > 0, sink)
            with kv_tap(kv_cache), kv_tap(attention_observer(observe, mask > 0, sink)):
                return model.layer(i, layer_params, hidden, mask, *hooks), sink

        def run_plain(i, layer_params, hidden, mask):
            with kv_tap(kv_cache):
                return model.layer(i, layer_params, hidden, mask, linear, grouped_linear)

        self.step = jax.jit(run_layer, static_argnums=0) if jit else run_layer
        self.plain_step = jax.jit(run_plain, static_argnums=0) if jit else run_plain
        self.sharded_step = sharded_step(run_layer, mesh) if mesh is not None else None
        self.sharded_plain = sharded_step(run_plain, mesh, observes=False) if mesh is not None else None
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
        running = None  # the summed entries' sums so far, folded on the devices (data_parallel.sharded_step)
        for s in range(0, self.split, group):  # whole groups: one batch per device
            out, sink, running = self.sharded_step(rep, layer_params, hidden[s:s + group], mask[s:s + group],
                                                   running)
            outs.append(out)
            sinks.append(sink)
            bound_in_flight(outs)
        # One transfer for all groups, once they are all dispatched; then one entry per batch.
        outs, sinks, totals = gathered(outs), to_host(sinks), to_host(running)
        for sink in sinks:
            self._add_entries(observed, sink, self.mesh.size, rep, i)
        self._add_sums(observed, jax.tree.map(unfolded, totals or {}), rep, i)
        for s in range(self.split, hidden.shape[0], b):  # the rest: on this process's first device
            out, sink = self.step(rep, layer_params, hidden[s:s + b], mask[s:s + b])
            outs.append(out)
            bound_in_flight(outs)
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
            bound_in_flight(outs)
        outs = gathered(outs)
        for s in range(self.split, hidden.shape[0], b):
            outs.append(self.plain_step(rep, layer_params, hidden[s:s + b], mask[s:s + b]))
            bound_in_flight(outs)
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
            bound_in_flight(outs)
        outs = gathered(outs)
        hidden_out = jnp.concatenate([jnp.asarray(o) for o in outs]) if len(outs) > 1 else jnp.asarray(outs[0])
        if not observes:
            return hidden_out
        observed: dict[str, list[Any]] = {}
        for (_, _, copies), sink in zip(spans, to_host(sinks)):
            self._add_entries(observed, sink, copies, rep, i)
        dense, owned = to_host(running)
        self._add_sums(observed, jax.tree.map(unfolded, dense), rep, i)
        self._add_sums(observed, {name: jax.tree.map(lambda value, e=e: value[e], sums)
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
        """The summed entries summed on the devices, as one device's first batch entry holds them."""
        for name, entries in sums.items():
            add_sums(observed[self.programs.rename(name, rep, i)][0], entries)



def forward_layerwise(model, params: Mapping, input_ids, attention_mask=None, *,
                      linear: LinearHook = dense_linear,
                      grouped_linear: GroupedLinearHook = dense_grouped_linear,
                      batch_size: int | None = None, jit: bool = True,
                      on_layer: Callable[[int], None] | None = None, kv_cache: KVTap | None = None) -> jax.Array:
    """model.forward computed layer by layer from lazily read weights (same result); `on_layer(i)` after
    layer i (progress); `kv_cache` as iterate_layers takes it."""
    hidden = None
    for result in iterate_layers(model, params, input_ids, attention_mask, linear=linear,
                                 grouped_linear=grouped_linear, batch_size=batch_size, jit=jit,
                                 kv_cache=kv_cache):
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

