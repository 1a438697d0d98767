"""int4 kernels with zero points (W4A16_ASYM), dense and grouped (MoE), against independent float64 numpy
products: the TPU kernels in TPU interpret mode (backend "cpu"), the Triton kernels in Pallas' generic
interpreter (backend "gpu"), and the pure-jnp references (backend "reference" plans) through qlinear.

The contract in numpy: each code less its group's zero point, times the group's scale in float32, rounded to
the activation dtype, then a float64 product.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qconvert.formats import QArray
from qconvert.kernels import (KernelArgumentError, gpu_dense, gpu_grouped, grouped_matmul, int4_weight_matmul,
                              qgrouped_linear, qlinear, tpu_dense, tpu_grouped)
from qconvert.kernels.reference import int4_weight_matmul_reference
from qconvert.kernels.tiles import Tiling

from ops_helpers import group_bounds

BF16 = jnp.bfloat16


def asym_weight(rng, *shape, group):
    """Random codes [..., N, K], scales and zero points per group (or per channel), and the float32 weight."""
    codes = rng.integers(-8, 8, shape).astype(np.int8)
    groups = 1 if group is None else shape[-1] // group
    scale = rng.uniform(0.01, 0.1, (*shape[:-1], groups)).astype(np.float32)
    zero = rng.integers(-8, 8, (*shape[:-1], groups)).astype(np.int8)
    repeat = shape[-1] if group is None else group
    weight = ((codes.astype(np.float32) - np.repeat(zero, repeat, axis=-1).astype(np.float32))
              * np.repeat(scale, repeat, axis=-1))
    return codes, scale, zero, weight


def as_dtype(a, dtype) -> np.ndarray:
    if dtype == BF16:
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(a, np.float32).astype(np.float64)


def assert_close_to_f64(y, expected, k):
    y = np.asarray(jnp.asarray(y).astype(jnp.float32))
    assert y.shape == expected.shape
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * np.sqrt(k) * scale / 10 + 1e-6)


DENSE_CASES = [
    ("cpu", 3, 4864, 200, 128, jnp.float32),
    ("cpu", 261, 576, 128, 64, BF16),
    ("cpu", 2, 1536, 128, None, jnp.float32),
    ("gpu", 5, 11008, 128, 128, jnp.float32),
    ("gpu", 7, 896, 200, 64, BF16),
]


@pytest.mark.parametrize("backend,m,k,n,group,x_dtype", DENSE_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}-g{c[4]}-{jnp.dtype(c[5]).name}" for c in DENSE_CASES])
def test_dense_kernels_subtract_the_zero_point(backend, m, k, n, group, x_dtype, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k + m)
    codes, scale, zero, weight = asym_weight(rng, n, k, group=group)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    bias = rng.normal(size=n).astype(np.float32)
    q = QArray(codes, scale, zero, kind="int4", block_size=group, shape=(n, k), dtype="float32")
    y, plan = qlinear(x, q, bias, out_dtype=jnp.float32, backend=backend, return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend and not plan.is_reference, plan.describe()
    expected = as_dtype(x, x_dtype) @ as_dtype(weight, x_dtype).T + bias
    assert_close_to_f64(y, expected, k)
    # Without the zero point the same codes give another product: the operand is not ignored.
    plain = int4_weight_matmul(x, codes, scale, group_size=group, bias=bias, backend=backend)
    assert np.abs(np.asarray(plain) - expected).max() > 100 * np.abs(np.asarray(y) - expected).max()


def test_the_reference_subtracts_the_zero_point():
    rng = np.random.default_rng(3)
    codes, scale, zero, weight = asym_weight(rng, 64, 768, group=128)
    x = rng.normal(size=(4, 768)).astype(np.float32)
    y = int4_weight_matmul_reference(x, codes, scale, group_size=128, w_zero=zero)
    assert_close_to_f64(y, x.astype(np.float64) @ weight.astype(np.float64).T, 768)


GROUPED_CASES = [
    ("cpu", 19, 4864, 200, 128, BF16, (11, 0, 5), 0),
    ("cpu", 261, 768, 128, None, jnp.float32, (3, 130, 0, 100), 1),
    ("gpu", 9, 2048, 200, 64, jnp.float32, (0, 6, 3), 0),
]


@pytest.mark.parametrize("backend,m,k,n,group,x_dtype,sizes,offset", GROUPED_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}-g{c[4]}" for c in GROUPED_CASES])
def test_grouped_kernels_subtract_each_experts_zero_points(backend, m, k, n, group, x_dtype, sizes, offset, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k + 7 * m)
    local = len(sizes) - offset if offset == 0 else 2
    codes, scale, zero, weight = asym_weight(rng, local, n, k, group=group)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    q = QArray(codes, scale, zero, kind="int4", block_size=group, shape=(local, n, k), dtype="float32")
    sizes = np.array(sizes, np.int32)
    y, plan = grouped_matmul(x, q, jnp.asarray(sizes), transpose_rhs=True, group_offset=offset, backend=backend,
                             return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend and not plan.is_reference
    bounds = group_bounds(sizes)
    expected = np.zeros((m, n))
    for e in range(local):
        rows = slice(bounds[e + offset], bounds[e + offset + 1])
        expected[rows] = as_dtype(x, x_dtype)[rows] @ as_dtype(weight[e], x_dtype).T
    assert_close_to_f64(y, expected, k)


def test_qgrouped_linear_stacks_the_experts_zero_points():
    rng = np.random.default_rng(11)
    experts = [asym_weight(rng, 128, 576, group=64) for _ in range(3)]
    qs = [QArray(c, s, z, kind="int4", block_size=64, shape=(128, 576), dtype="float32") for c, s, z, _ in experts]
    sizes = np.array([4, 0, 5], np.int32)
    x = rng.normal(size=(9, 576)).astype(np.float32)
    y = qgrouped_linear(x, qs, jnp.asarray(sizes), backend="cpu")
    expected = np.concatenate([x[:4] @ experts[0][3].T.astype(np.float64), x[4:] @ experts[2][3].T.astype(np.float64)])
    assert_close_to_f64(y, expected, 576)
    with pytest.raises(KernelArgumentError, match="zero points or none"):
        qgrouped_linear(x, [qs[0], QArray(experts[1][0], experts[1][1], kind="int4", block_size=64,
                                          shape=(128, 576), dtype="float32"), qs[2]], jnp.asarray(sizes))


def test_zero_points_of_the_wrong_shape_are_refused():
    x = np.ones((2, 128), np.float32)
    with pytest.raises(KernelArgumentError, match="w_zero must be integer zero points"):
        int4_weight_matmul(x, np.zeros((8, 128), np.int8), np.ones((8, 2), np.float32), group_size=64,
                           w_zero=np.zeros((8, 1), np.int8))


S = jax.ShapeDtypeStruct
I32 = jnp.int32


def lowered_text(fn, args, platform, **static):
    return jax.jit(functools.partial(fn, **static)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_dense_kernels_with_zero_points_lower_for_tpu_and_gpu(x_dtype):
    # The Mosaic and Triton lowerings (conftest runs MLIR's verifier on each): K 2048 in tiles of 512 with groups
    # of 128 (TPU); the K row's 16 groups (GPU).
    static = dict(out_dtype=jnp.bfloat16, has_bias=True, interpret=False)
    x = (S((16, 1024), x_dtype), S((16, 1024), x_dtype), S((512, 1024), jnp.int8))
    bias = S((1, 512), jnp.float32)

    def with_zeros(kernel):  # zeros as a traced operand, after the others
        return lambda *args, **kw: kernel(*args[:-1], zeros=args[-1], **kw)

    groups = S((4, 512, 4), jnp.float32)
    assert "tpu_custom_call" in lowered_text(with_zeros(tpu_dense.int4_weight_matmul_tpu), (*x, groups, bias, groups),
                                             "tpu", tiling=Tiling(16, 512, 256), **static)
    groups = S((512, 16), jnp.float32)
    assert "triton" in lowered_text(with_zeros(gpu_dense.int4_weight_matmul_gpu), (*x, groups, bias, groups), "cuda",
                                    tiling=Tiling(16, 256, 32), **static)


def test_grouped_kernels_with_zero_points_lower_for_tpu_and_gpu():
    metadata = (S((5,), I32), S((12,), I32), S((12,), I32))
    lhs = (S((256, 256), jnp.bfloat16),) * 2
    rhs = (S((4, 256, 256), jnp.int8), S((4, 1, 256, 8), jnp.float32), S((4, 1, 256, 8), jnp.float32))
    text = lowered_text(tpu_grouped.grouped_matmul_tpu, (metadata, S((1,), I32), S((1,), I32), lhs, rhs), "tpu",
                        tiling=Tiling(128, 512, 256), out_dtype=jnp.bfloat16, rhs_kind="int4", transpose_rhs=True,
                        interpret=False)
    assert "tpu_custom_call" in text
    tables = (S((7,), I32), S((6,), I32), S((6,), I32))
    lhs = (S((96, 384), jnp.bfloat16),) * 2
    rhs = (S((6, 256, 384), jnp.int8), S((6, 256, 24), jnp.float32), S((6, 256, 24), jnp.float32))
    text = lowered_text(gpu_grouped.grouped_matmul_gpu, (*tables, lhs, rhs), "cuda", tiling=Tiling(16, 64, 32),
                        out_dtype=jnp.bfloat16, rhs_kind="int4", transpose_rhs=True, interpret=False)
    assert "__gpu$xla.gpu.triton" in text
