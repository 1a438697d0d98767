"""qconvert.ops on int4 QArrays: plain matmuls take the W4A16 kernel (interpreted on CPU), the rest
dequantize, and the shape ops keep the grouped last axis whole; all against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import int4_qarray, int4_values

from qconvert import ops
from qconvert.formats import QArray
from qconvert.ops.dispatch import DEQUANTIZE, INT4_WEIGHT_KERNEL

DN = (((2,), (1,)), ((), ()))  # x [b, t, k] . w [n, k]


@pytest.mark.parametrize("group_size", [32, None])
def test_int4_weight_takes_its_kernel_matches_numpy_and_has_a_gradient(group_size):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 576)).astype(np.float32)
    w = int4_qarray(rng.standard_normal((96, 576)), group_size)
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = jax.jit(lambda a, b: ops.dot_general(a, b, DN))(x, w)
        grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN) ** 2))(x)
    assert decisions[0].path == INT4_WEIGHT_KERNEL
    w_float = int4_values(w).astype(np.float64)
    ref = np.einsum("btk,nk->btn", x, w_float)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), 2 * np.einsum("btn,nk->btk", ref, w_float), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("group_size", [64, None])
def test_an_int4_weight_with_zero_points_takes_the_kernel_too(group_size):
    # W4A16_ASYM: each code less its group's integer zero point, times the group's scale.
    rng = np.random.default_rng(2)
    n, k = 48, 256
    groups = 1 if group_size is None else k // group_size
    codes = rng.integers(-8, 8, (n, k)).astype(np.int8)
    scale = rng.uniform(0.01, 0.03, (n, groups)).astype(np.float32)
    zero = rng.integers(-4, 5, (n, groups)).astype(np.int8)
    w = QArray(codes, scale, zero, kind="int4", block_size=group_size, shape=(n, k), dtype="float32")
    w_float = (codes.astype(np.float64) - np.repeat(zero, k // groups, axis=1)) * np.repeat(scale, k // groups,
                                                                                              axis=1)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = jax.jit(lambda a, b: ops.dot_general(a, b, DN))(x, w)
        grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN) ** 2))(x)
    assert decisions[0].path == INT4_WEIGHT_KERNEL, decisions[0]
    ref = np.einsum("btk,nk->btn", x, w_float)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), 2 * np.einsum("btn,nk->btk", ref, w_float), rtol=1e-4, atol=1e-3)


def test_on_cpu_by_default_an_int4_weight_dequantizes_and_einsum_agrees():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 128)).astype(np.float32)
    w = int4_qarray(rng.standard_normal((16, 128)), 64)
    with ops.record_paths() as decisions:
        out = ops.einsum("btk,nk->btn", x, w)
    assert decisions[0].path == DEQUANTIZE and "interprets" in decisions[0].reason
    np.testing.assert_allclose(np.asarray(out), np.einsum("btk,nk->btn", x, int4_values(w)), rtol=1e-5, atol=1e-5)


def test_a_weight_contracted_on_its_first_axis_is_not_sent_to_the_int4_kernel():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = int4_qarray(rng.standard_normal((64, 8)))  # [K, N]: its groups run along N
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = ops.dot_general(x, w, (((1,), (0,)), ((), ())))
    assert decisions[0].path == DEQUANTIZE and "[N, K]" in decisions[0].reason
    np.testing.assert_allclose(np.asarray(out), x @ int4_values(w), rtol=1e-5, atol=1e-5)


def test_ragged_dot_and_the_moe_hook_take_int4_experts():
    rng = np.random.default_rng(3)
    experts = [int4_qarray(rng.standard_normal((24, 256)), 128) for _ in range(3)]
    x = rng.standard_normal((10, 256)).astype(np.float32)
    sizes = np.array([4, 0, 5], np.int32)  # an empty expert, and a row in none
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    expected = np.zeros((10, 24))
    for e, w in enumerate(experts):
        expected[bounds[e]:bounds[e + 1]] = x[bounds[e]:bounds[e + 1]] @ int4_values(w).astype(np.float64).T
    out = ops.grouped_linear("mlp.experts", jnp.asarray(x), experts, jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)
    stacked = ops.stack(experts)  # [E, N, K], contracted on K: ragged_dot_general dequantizes it
    dims = jax.lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
    out = ops.ragged_dot_general(x, stacked, jnp.asarray(sizes), dims, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)


def test_shape_ops_keep_the_grouped_last_axis_whole():
    rng = np.random.default_rng(4)
    w = int4_qarray(rng.standard_normal((2, 6, 256)), 64)
    values = int4_values(w)
    cases = [
        (ops.transpose(w, (1, 0, 2)), values.transpose(1, 0, 2)),
        (ops.reshape(w, (12, 256)), values.reshape(12, 256)),
        (ops.slice_in_dim(w, 64, 192, axis=2), values[..., 64:192]),
        (ops.slice_in_dim(w, 1, 4, axis=1), values[:, 1:4]),
        (ops.stack([w, w], axis=2), np.stack([values, values], axis=2)),
    ]
    for q, expected in cases:
        assert q.kind == "int4" and q.shape == expected.shape
        np.testing.assert_array_equal(int4_values(q), expected)
    for refused in (lambda: ops.transpose(w, (0, 2, 1)), lambda: ops.reshape(w, (2, 6, 4, 64)),
                    lambda: ops.slice_in_dim(w, 32, 128, axis=2), lambda: ops.stack([w, w], axis=3)):
        with pytest.raises(ops.PackedLayoutError):
            refused()
