"""The linear hooks every forward pass runs its linears through, and their float defaults.

A forward never multiplies by a weight itself: it calls

    linear(name, x, weight, bias) -> y

with `name` the module name ("model.layers.0.self_attn.q_proj"), x [..., in],
weight [out, in] (a jax/numpy array or a QArray), bias [out] or None. Calibration
swaps in a hook that also records max|x|; verify swaps in quantized kernels.

Mixture-of-experts layers run their experts through one grouped call instead:

    grouped_linear(names, x, weights, group_sizes) -> y

with `names` the E expert module names, x [M, in] whose rows are sorted by
expert (expert e owns the next group_sizes[e] rows), `weights` the E expert
weights [out, in], group_sizes int32 [E]. Rows past sum(group_sizes) belong to
no expert; their output is zero. The float default runs XLA's ragged_dot (see
_grouped_matmul), never a Pallas kernel.

Both hooks are pure functions of their arrays, so a forward that uses them can
be traced by jax.jit.

An attention block hands its keys after RoPE and its values, [B, heads, T, head_dim], as a KV cache stores
them, to

    keys, values = cached_kv(name, keys, values)

with `name` the attention module ("model.layers.0.self_attn"). It returns them unchanged unless a caller
tapped the cache (`kv_tap`) while the layer is traced: calibration observes them there, and verify rounds
them as an FP8 cache would. The tap is set around the trace, not passed through every family's signature.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from qconvert.formats import QArray
from qconvert.formats.qarray import is_prepared

LinearHook = Callable[[str, jax.Array, Any, Any], jax.Array]
GroupedLinearHook = Callable[[Sequence[str], jax.Array, Sequence[Any], jax.Array], jax.Array]
# tap(name, keys, values) -> (keys, values): what a traced layer's KV cache holds, observed or replaced.
KVTap = Callable[[str, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]

_KV_TAPS: contextvars.ContextVar[tuple[KVTap, ...]] = contextvars.ContextVar("kv_taps", default=())


@contextlib.contextmanager
def kv_tap(tap: KVTap | None) -> Iterator[None]:
    """Within the block, every `cached_kv` call passes its keys and values through `tap` (after the taps set
    outside it); None sets nothing."""
    if tap is None:
        yield
        return
    token = _KV_TAPS.set(_KV_TAPS.get() + (tap,))
    try:
        yield
    finally:
        _KV_TAPS.reset(token)


def cached_kv(name: str, keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """An attention block's keys (after RoPE) and values as its KV cache holds them: through the taps set."""
    for tap in _KV_TAPS.get():
        keys, values = tap(name, keys, values)
    return keys, values


def as_float32(weight: Any) -> jax.Array:
    """A weight as a float32 jax array; a QArray (or a prepared weight) is dequantized."""
    if isinstance(weight, QArray):
        return weight.dequantize(jnp.float32)
    if is_prepared(weight):
        return weight.dequantize(jnp.float32)
    return jnp.asarray(weight).astype(jnp.float32)


def dense_linear(name: str, x: jax.Array, weight: Any, bias: Any = None) -> jax.Array:
    """y = x W^T + b in float32 (the float reference every other hook is judged against)."""
    y = jnp.matmul(x.astype(jnp.float32), as_float32(weight).T,
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + as_float32(bias)
    return y


def _grouped_matmul(x: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, in] times rhs [E, in, out] by groups of rows (rows past the groups give 0), in XLA.

    Always XLA's ragged_dot, never a Pallas kernel: this is the float side that
    verify judges the grouped kernels against (and the float model calibration
    runs), so a bug in a grouped kernel cannot hide on both sides of a comparison.
    """
    return jax.lax.ragged_dot(x, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST)


def dense_grouped_linear(names: Sequence[str], x: jax.Array, weights: Sequence[Any],
                         group_sizes: jax.Array) -> jax.Array:
    """Float grouped linear: row block e of x times weights[e]^T; rows past the groups give 0."""
    rhs = jnp.stack([as_float32(w).T for w in weights])  # [E, in, out]
    y = _grouped_matmul(x.astype(jnp.float32), rhs, group_sizes.astype(jnp.int32))
    # Rows past the last group belong to no expert: zero, whatever ragged_dot leaves there.
    rows = jnp.arange(x.shape[0])
    return jnp.where((rows < jnp.sum(group_sizes))[:, None], y, 0.0)
