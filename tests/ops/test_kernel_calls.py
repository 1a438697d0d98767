"""qconvert.ops routes plain matmuls to the Pallas kernels (interpreted on CPU) with the right results."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from ops_helpers import int8_qarray, int8_values, nf4_qarray, nf4_values

from qconvert import ops
from qconvert.ops.dispatch import DEQUANTIZE, INT8_INT32, INT8_KERNEL, INT8_WEIGHT_KERNEL, NF4_KERNEL

DN = (((2,), (1,)), ((), ()))  # x [b, t, k] . w [n, k]


def test_on_cpu_by_default_the_xla_integer_path_is_chosen_over_interpreted_kernels():
    rng = np.random.default_rng(0)
    x = int8_qarray(rng.standard_normal((2, 3, 64)), shared_axes=(2,))
    w = int8_qarray(rng.standard_normal((8, 64)), shared_axes=(1,))
    with ops.record_paths() as decisions:
        ops.dot_general(x, w, DN)
    assert decisions[0].path == INT8_INT32 and "interprets" in decisions[0].reason


def test_int8_kernel_path_is_bit_exact_against_an_int32_reference():
    rng = np.random.default_rng(1)
    x = int8_qarray(rng.standard_normal((2, 3, 64)), shared_axes=(2,))  # per token
    w = int8_qarray(rng.standard_normal((8, 64)), shared_axes=(1,))  # per output channel
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = ops.dot_general(x, w, DN)
    assert decisions[0].path == INT8_KERNEL
    acc = np.einsum("btk,nk->btn", np.asarray(x.qvalue, np.int32), np.asarray(w.qvalue, np.int32))
    x_scale = np.asarray(x.scale, np.float32)  # [2, 3, 1]
    w_scale = np.asarray(w.scale, np.float32)[:, 0]  # [8]
    np.testing.assert_array_equal(np.asarray(out), (acc.astype(np.float32) * x_scale) * w_scale)


def test_int8_weight_kernel_path_matches_dot_on_dequantized_weight_and_has_a_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = int8_qarray(rng.standard_normal((8, 64)), shared_axes=(1,))
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = ops.dot_general(x, w, DN)
        grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN)))(x)
    assert decisions[0].path == INT8_WEIGHT_KERNEL
    np.testing.assert_allclose(np.asarray(out), np.einsum("btk,nk->btn", x, int8_values(w)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.broadcast_to(int8_values(w).sum(0), x.shape), rtol=1e-5, atol=1e-5)


def test_nf4_kernel_path_matches_dot_on_decoded_weight_and_has_a_gradient():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = nf4_qarray(rng.standard_normal((8, 64)))
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = jax.jit(lambda a, b: ops.dot_general(a, b, DN))(x, w)
        grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN) ** 2))(x)
    assert decisions[0].path == NF4_KERNEL
    w_float = nf4_values(w)
    ref = np.einsum("btk,nk->btn", x, w_float)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), 2 * np.einsum("btn,nk->btk", ref, w_float), rtol=1e-4, atol=1e-4)


def test_a_weight_contracted_on_its_first_axis_is_not_sent_to_the_nf4_kernel():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = nf4_qarray(rng.standard_normal((64, 8)))  # [K, N]
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = ops.dot_general(x, w, (((1,), (0,)), ((), ())))
    assert decisions[0].path == DEQUANTIZE and "[N, K]" in decisions[0].reason
    np.testing.assert_allclose(np.asarray(out), x @ nf4_values(w), rtol=1e-4, atol=1e-4)
