"""QArrays through jit, vmap and grad; packed shape ops; straight-through QAT with ops.ste."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import int8_qarray, int8_values, nf4_qarray, nf4_values

from qconvert import ops
from qconvert.formats import QArray
from qconvert.ops.dispatch import INT8_INT32, INT8_KERNEL

DN = (((1,), (1,)), ((), ()))  # x [m, k] . w [n, k]


def test_jit_with_qarray_arguments_matches_eager_reference():
    rng = np.random.default_rng(0)
    x = int8_qarray(rng.standard_normal((4, 16)), shared_axes=(1,))
    w = int8_qarray(rng.standard_normal((8, 16)), shared_axes=(1,))
    with ops.record_paths() as decisions:
        out = jax.jit(lambda a, b: ops.dot_general(a, b, DN))(x, w)
    assert decisions[0].path in (INT8_INT32, INT8_KERNEL)
    ref = int8_values(x) @ int8_values(w).T
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_vmap_over_stacked_int8_weights():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    experts = int8_qarray(rng.standard_normal((4, 8, 16)), shared_axes=(2,))  # 4 stacked [out, in] weights
    xq = int8_qarray(x, shared_axes=(1,))
    out = jax.vmap(lambda w: ops.dot_general(xq, w, DN))(experts)
    ref = np.einsum("mk,enk->emn", int8_values(xq), int8_values(experts))
    assert out.shape == (4, 3, 8)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_vmap_over_float_activations_with_a_fixed_nf4_weight():
    rng = np.random.default_rng(2)
    xs = rng.standard_normal((5, 2, 64)).astype(np.float32)
    w = nf4_qarray(rng.standard_normal((8, 64)))
    out = jax.vmap(lambda x: ops.dot_general(x, w, DN))(xs)
    np.testing.assert_allclose(np.asarray(out), np.einsum("bmk,nk->bmn", xs, nf4_values(w)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make_weight", [lambda w: int8_qarray(w, shared_axes=(1,)), nf4_qarray])
def test_grad_with_respect_to_the_float_operand(make_weight):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = make_weight(rng.standard_normal((8, 64)))
    w_float = int8_values(w) if w.kind == "int8" else nf4_values(w)
    g = rng.standard_normal((3, 8)).astype(np.float32)
    grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN) * g))(x)
    np.testing.assert_allclose(np.asarray(grad), g @ w_float, rtol=1e-4, atol=1e-4)


def test_grad_of_einsum_and_ragged_dot_with_quantized_weights():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    w = int8_qarray(rng.standard_normal((2, 16, 4)), shared_axes=(1,))
    sizes = jnp.array([2, 4], jnp.int32)
    grad = jax.grad(lambda a: jnp.sum(ops.ragged_dot(a, w, sizes)))(x)
    group_of_row = np.repeat([0, 1], [2, 4])
    expected = np.stack([int8_values(w)[g].sum(axis=1) for g in group_of_row])
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-5)
    w2 = int8_qarray(rng.standard_normal((4, 16)), shared_axes=(1,))
    grad2 = jax.grad(lambda a: jnp.sum(ops.einsum("mk,nk->mn", a, w2)))(x)
    np.testing.assert_allclose(np.asarray(grad2), np.tile(int8_values(w2).sum(0), (6, 1)), rtol=1e-5, atol=1e-5)


def _qdq_int8_numpy(w):
    scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-8) / 127.0
    return np.clip(np.rint(w / scale), -127, 127) * scale


def _quantize_per_row(w):
    """A traceable int8 quantizer (per output row) used as the forward of the STE."""
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1, keepdims=True), 1e-8) / 127.0
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return QArray(q, scale, kind="int8", shape=w.shape, dtype=str(w.dtype))


def test_ste_forward_is_quantize_dequantize_and_gradient_is_identity():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    qdq = ops.ste(_quantize_per_row)
    np.testing.assert_allclose(np.asarray(qdq(w)), _qdq_int8_numpy(w), rtol=1e-6, atol=1e-7)
    g = rng.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda v: jnp.sum(qdq(v) * g))(w)), g)


def test_qat_step_with_ste_updates_the_float_master_weights():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 4)).astype(np.float32)
    master = rng.standard_normal((4, 8)).astype(np.float32)
    qdq = ops.ste(_quantize_per_row)

    def loss(w):
        pred = ops.dot_general(x, qdq(w), DN)
        return jnp.mean((pred - y) ** 2)

    @jax.jit
    def step(w):
        return w - 0.1 * jax.grad(loss)(w)

    updated = step(master)
    # Straight-through: dL/dw is dL/dq evaluated at q = qdq(w), here 2/N (x q^T - y)^T x.
    q = _qdq_int8_numpy(master)
    expected_grad = (2.0 / y.size) * (x @ q.T - y).T @ x
    np.testing.assert_allclose(np.asarray(updated), master - 0.1 * expected_grad, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(updated), master)
    assert float(loss(updated)) < float(loss(master))


def test_int8_transpose_and_slice_stay_packed_and_match_float_ops():
    rng = np.random.default_rng(7)
    q = int8_qarray(rng.standard_normal((3, 4, 5)), shared_axes=(1,))
    t = ops.transpose(q, (2, 0, 1))
    assert t.qvalue.dtype == jnp.int8 and t.shape == (5, 3, 4) and t.scale.shape == (5, 3, 1)
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.transpose(int8_values(q), (2, 0, 1)))
    s = ops.slice_in_dim(q, 1, 5, stride=2, axis=2)
    assert s.qvalue.dtype == jnp.int8 and s.shape == (3, 4, 2)
    np.testing.assert_array_equal(np.asarray(s.dequantize()), int8_values(q)[:, :, 1:5:2])


@pytest.mark.parametrize(
    "old,shared,new,raises",
    [
        ((2, 3, 4), (2,), (6, 4), False),  # merges axes 0 and 1, both with a scale per index
        ((2, 3, 4), (2,), (2, 3, 2, 2), False),  # splits the shared axis: stays shared
        ((2, 3, 4), (1, 2), (2, 12), False),  # merges two shared axes
        ((2, 3, 4), (2,), (2, 12), True),  # merges a per-index axis with a shared one
        ((4, 6), (1,), (4, 1, 6, 1), False),  # size-1 axes come and go
    ],
)
def test_int8_reshape_keeps_packing_unless_it_mixes_shared_and_unshared_axes(old, shared, new, raises):
    rng = np.random.default_rng(8)
    q = int8_qarray(rng.standard_normal(old), shared_axes=shared)
    if raises:
        with pytest.raises(ops.PackedLayoutError):
            ops.reshape(q, new)
        return
    r = ops.reshape(q, new)
    assert r.qvalue.dtype == jnp.int8 and r.shape == new and r.scale.ndim == len(new)
    np.testing.assert_array_equal(np.asarray(r.dequantize()), int8_values(q).reshape(new))


def test_nf4_reshape_and_row_slice_stay_packed():
    rng = np.random.default_rng(9)
    q = nf4_qarray(rng.standard_normal((8, 32)))  # 4 blocks of 64 = 2 rows each
    r = ops.reshape(q, (4, 64))
    assert r.qvalue is q.qvalue
    np.testing.assert_array_equal(np.asarray(r.dequantize()), nf4_values(q).reshape(4, 64))
    s = ops.slice_in_dim(q, 2, 6)
    assert s.qvalue.shape == (64,) and s.scale.shape == (2,)
    np.testing.assert_array_equal(np.asarray(s.dequantize()), nf4_values(q)[2:6])


def test_nf4_ops_that_would_reblock_raise_and_say_to_dequantize():
    q = nf4_qarray(np.random.default_rng(10).standard_normal((8, 32)))
    with pytest.raises(ops.PackedLayoutError, match="dequantize"):
        ops.transpose(q, (1, 0))
    with pytest.raises(ops.PackedLayoutError, match="dequantize"):
        ops.slice_in_dim(q, 1, 4)
    with pytest.raises(ops.PackedLayoutError, match="dequantize"):
        ops.slice_in_dim(q, 0, 16, axis=1)


def test_shape_ops_on_plain_arrays_are_the_lax_ops():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(ops.transpose(x, (1, 0, 2)), jax.lax.transpose(x, (1, 0, 2)))
    np.testing.assert_array_equal(ops.reshape(x, (6, 4)), x.reshape(6, 4))
    np.testing.assert_array_equal(ops.slice_in_dim(x, 1, 3, axis=2), x[:, :, 1:3])


def test_stack_keeps_int8_and_nf4_packed():
    rng = np.random.default_rng(11)
    int8s = [int8_qarray(rng.standard_normal((4, 8)), shared_axes=(1,)) for _ in range(3)]
    s = ops.stack(int8s, axis=1)
    assert s.shape == (4, 3, 8) and s.qvalue.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(s.dequantize()), np.stack([int8_values(q) for q in int8s], axis=1))
    nf4s = [nf4_qarray(rng.standard_normal((2, 64))) for _ in range(3)]
    t = ops.stack(nf4s)
    assert t.shape == (3, 2, 64) and t.qvalue.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.stack([nf4_values(q) for q in nf4s]))
    with pytest.raises(ops.PackedLayoutError):
        ops.stack([nf4_qarray(rng.standard_normal((2, 20)))] * 2)  # 40 elements: blocks would straddle


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_grouped_linear_hook_multiplies_each_row_group_by_its_expert(kind):
    rng = np.random.default_rng(12)
    floats = [rng.standard_normal((5, 64)).astype(np.float32) for _ in range(3)]
    weights = [int8_qarray(w, shared_axes=(1,)) if kind == "int8" else nf4_qarray(w) for w in floats]
    values = [int8_values(w) if kind == "int8" else nf4_values(w) for w in weights]
    x = rng.standard_normal((8, 64)).astype(np.float32)
    sizes = np.array([3, 0, 4])  # the last row belongs to no expert
    y = ops.grouped_linear(["e0", "e1", "e2"], x, weights, jnp.asarray(sizes))
    group_of_row = np.repeat(np.arange(3), sizes)
    expected = np.zeros((8, 5), np.float32)
    for row, e in enumerate(group_of_row):
        expected[row] = values[e] @ x[row]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-4)
