"""The data-parallel program: each device runs whole batches of a layer, weights replicated, sums in batch order.

With several processes the mesh spans them all; every process hands in the same group of batches and gathers
every device's outputs, so each runs the next layer from the same hidden states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qconvert.calibration.device_sums import fold_sums, ordered_fold, split_sink


def gathered(outs: list) -> list:
    """Outputs of the sharded steps as arrays of this process: as they are with one process; with several,
    every process gathers every device's rows (each process runs the next layer's batches from them)."""
    if not outs or jax.process_count() == 1:
        return outs
    from jax.experimental import multihost_utils

    return [jnp.asarray(a) for a in multihost_utils.process_allgather(outs, tiled=True)]


def to_host(tree):
    """A pytree of the sharded steps' results as numpy arrays: every device's, on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def bound_in_flight(outs: list) -> None:
    """Wait for the batch before the last: dispatch runs ahead of the device, and every batch
    in flight holds its own activations, so at most two are (calib_memory counts two)."""
    if len(outs) >= 2 and isinstance(outs[-2], jax.Array):
        outs[-2].block_until_ready()


def sharded_step(run_layer, mesh: Mesh, observes: bool = True):
    """run_layer over a [devices * batch] group: each device runs its own batch, weights replicated. The mesh may
    span several processes (each then hands in the same group; the results are sharded over all devices).

    Observing, it returns (output, what `observe` returned less its summed entries, one leading entry per device,
    and `running`: those entries' sums over every batch so far, this group's added on the devices). A sum is
    folded in batch order (ordered_fold), so it holds the very floats one device's running sum holds, and only
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
            sums, rest = split_sink(sink)
            folded = fold_sums(sums, running, ordered_fold, devices)
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

