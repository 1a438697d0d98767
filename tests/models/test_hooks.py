"""The float side of every MoE comparison (verify's reference model, calibration) runs in XLA, never
through the Pallas grouped kernel it is used to judge, on any backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qconvert.models import hooks

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_float_grouped_linear_is_xla_ragged_dot_on_every_backend(platform, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    sizes = np.array([3, 0, 4], np.int32)  # 7 of 9 rows routed; expert 1 empty
    x = RNG.normal(size=(9, 64)).astype(np.float32)
    weights = [RNG.normal(size=(40, 64)).astype(np.float32) for _ in range(3)]
    names = [f"model.layers.0.block_sparse_moe.experts.{e}.w1" for e in range(3)]
    jaxpr = str(jax.make_jaxpr(hooks.dense_grouped_linear, static_argnums=(0,))(
        tuple(names), jnp.asarray(x), weights, jnp.asarray(sizes)))
    assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr
    y = np.asarray(hooks.dense_grouped_linear(names, jnp.asarray(x), weights, jnp.asarray(sizes)))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    expected = np.zeros((9, 40))
    for e, w in enumerate(weights):
        expected[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]].astype(np.float64) @ w.T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)
