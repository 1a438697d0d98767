"""int4 W4A16 kernels, dense and grouped (MoE), against independent float64 numpy products: the TPU kernels
in TPU interpret mode (backend "cpu"), the Triton kernels in Pallas' generic interpreter (backend "gpu").

The contract in numpy: each code times its group's scale in float32, rounded to
the activation dtype, then a float64 product (the kernels accumulate in
float32, hence the tolerance). K runs to 18944 with M and N kept small; every
group size (32, 64, 128, per channel) runs on both backends, dense and grouped.
"""

import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from qconvert.formats import QArray
from qconvert.kernels import (KernelArgumentError, grouped_matmul, int4_weight_matmul, qgrouped_linear, qlinear,
                              select_kernel, stack_experts)
from qconvert.kernels.plan import KernelProblem
from qconvert.kernels.tiles import Tiling, int4_nibbles, pack_int4_pairs

from ops_helpers import group_bounds

BF16 = jnp.bfloat16


def int4_weight(rng, *shape, group):
    """Random codes in [-8, 7] [..., N, K], scales per group (or per channel), and the weight in float32."""
    codes = rng.integers(-8, 8, shape).astype(np.int8)
    k = shape[-1]
    scale = rng.uniform(0.01, 0.1, (*shape[:-1], 1 if group is None else k // group)).astype(np.float32)
    per_column = scale if group is None else np.repeat(scale, group, axis=-1)
    return codes, scale, codes.astype(np.float32) * per_column  # numpy's float32 product: the dequantize


def as_dtype(a, dtype) -> np.ndarray:
    """a rounded to the activation dtype, back in float64."""
    if dtype == BF16:
        return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(a, np.float32).astype(np.float64)


def assert_close_to_f64(y, expected, k):
    # float32 accumulation over K terms; a wrong group scale, a swapped nibble or a dropped K tile is off by
    # far more than this
    y = np.asarray(jnp.asarray(y).astype(jnp.float32))
    assert y.shape == expected.shape
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * np.sqrt(k) * scale / 10 + 1e-6)


def test_pack_int4_pairs_hand_worked():
    # (low, high) = (-8, 7) -> 0x78; (-1, 0) -> 0x0F; (3, -5) -> 0xB3, which as a signed byte is -77
    codes = np.array([[-8, 7, -1, 0, 3, -5]], np.int8)
    packed = pack_int4_pairs(jnp.asarray(codes))
    assert packed.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(packed), [[0x78, 0x0F, -77]])


def test_int4_nibbles_sign_extend_every_byte():
    byte = np.arange(-128, 128, dtype=np.int32)  # every int8 byte, sign-extended as the kernels load it
    unsigned = byte & 0xFF
    low_u, high_u = unsigned & 0xF, unsigned >> 4
    low, high = int4_nibbles(jnp.asarray(byte))
    np.testing.assert_array_equal(np.asarray(low), np.where(low_u >= 8, low_u - 16, low_u))
    np.testing.assert_array_equal(np.asarray(high), np.where(high_u >= 8, high_u - 16, high_u))


def test_every_pair_of_codes_survives_packing():
    pairs = np.array([(a, b) for a in range(-8, 8) for b in range(-8, 8)], np.int8).reshape(1, -1)
    low, high = int4_nibbles(pack_int4_pairs(jnp.asarray(pairs)).astype(jnp.int32))
    np.testing.assert_array_equal(np.asarray(low), pairs[:, 0::2])
    np.testing.assert_array_equal(np.asarray(high), pairs[:, 1::2])


# (backend, m, k, n, group, x dtype, bias, out dtype): every group size on both backends, K up to 18944, M of
# one row, an odd count, and more rows than the largest row tile (256 TPU, 128 GPU); N a tile multiple or not.
DENSE_CASES = [
    ("cpu", 1, 18944, 128, 128, jnp.float32, True, jnp.float32),
    ("cpu", 7, 4864, 200, 64, BF16, True, jnp.float32),
    ("cpu", 261, 576, 200, 32, jnp.float32, False, jnp.float32),
    ("cpu", 3, 3584, 128, None, BF16, False, BF16),
    ("cpu", 5, 1536, 128, 256, jnp.float32, False, jnp.float32),
    ("gpu", 1, 18944, 128, 32, BF16, False, jnp.float32),
    ("gpu", 7, 4864, 200, None, jnp.float32, True, jnp.float32),
    ("gpu", 261, 896, 128, 128, BF16, True, BF16),
    ("gpu", 3, 2048, 200, 64, jnp.float32, False, jnp.float32),
]


@pytest.mark.parametrize("backend,m,k,n,group,x_dtype,with_bias,out_dtype", DENSE_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}-g{c[4]}-{jnp.dtype(c[5]).name}"
                              f"{'-bias' if c[6] else ''}" for c in DENSE_CASES])
def test_int4_weight_matmul_matches_float64_dequantized_product(backend, m, k, n, group, x_dtype, with_bias,
                                                                 out_dtype, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k * 31 + m)
    codes, scale, weight = int4_weight(rng, n, k, group=group)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    bias = rng.normal(size=n).astype(np.float32) if with_bias else None
    y, plan = int4_weight_matmul(x, codes, scale, group_size=group, bias=bias, out_dtype=out_dtype, backend=backend,
                                 return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend and plan.op == "int4_weight_matmul", plan.describe()
    assert y.dtype == out_dtype and plan.tiling.tk % (group or 1) == 0
    expected = as_dtype(x, x_dtype) @ as_dtype(weight, x_dtype).T + (0 if bias is None else bias)
    if out_dtype == BF16:
        np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), expected, rtol=1e-2,
                                   atol=1e-2 * np.abs(expected).max())
    else:
        assert_close_to_f64(y, expected, k)


def grouped_expected(x, weights, sizes, offset=0):
    """weights[l] is group (l + offset)'s float64 [N, K]; rows of other groups are 0."""
    bounds = group_bounds(sizes)
    out = np.zeros((x.shape[0], weights[0].shape[0]))
    for local, w in enumerate(weights):
        g = local + offset
        out[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]] @ w.T
    return out


# (backend, m, k, n, group, x dtype, group sizes, group offset): empty groups, uneven groups, rows past the
# groups, and a shard of the experts (two local experts of four, from expert 1).
GROUPED_CASES = [
    ("cpu", 5, 18944, 128, 32, jnp.float32, (2, 0, 3), 0),
    ("cpu", 19, 4864, 200, 128, BF16, (11, 0, 5), 0),
    ("cpu", 261, 768, 128, None, jnp.float32, (3, 130, 0, 100), 1),
    ("cpu", 9, 2048, 200, 64, BF16, (0, 6, 3), 0),
    ("gpu", 5, 18944, 128, 64, BF16, (2, 0, 3), 0),
    ("gpu", 19, 4864, 200, None, jnp.float32, (11, 0, 5), 0),
    ("gpu", 261, 768, 128, 32, BF16, (3, 130, 0, 100), 1),
    ("gpu", 9, 3072, 200, 128, jnp.float32, (0, 6, 3), 0),
]


@pytest.mark.parametrize("backend,m,k,n,group,x_dtype,sizes,offset", GROUPED_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}-g{c[4]}-{jnp.dtype(c[5]).name}" for c in GROUPED_CASES])
def test_grouped_int4_experts_match_per_group_float64_products(backend, m, k, n, group, x_dtype, sizes, offset,
                                                                request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k * 17 + m)
    local = len(sizes) - offset if offset == 0 else 2
    codes, scale, weight = int4_weight(rng, local, n, k, group=group)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    q = QArray(codes, scale, kind="int4", block_size=group, shape=(local, n, k), dtype=jnp.dtype(x_dtype).name)
    sizes = np.array(sizes, np.int32)
    y, plan = grouped_matmul(x, q, jnp.asarray(sizes), transpose_rhs=True, group_offset=offset, backend=backend,
                             return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend and plan.tiling.tk % (group or 1) == 0
    expected = grouped_expected(as_dtype(x, x_dtype), [as_dtype(w, x_dtype) for w in weight], sizes, offset)
    assert_close_to_f64(y, expected, k)
    bounds = group_bounds(sizes)
    assert not np.asarray(y[bounds[offset + local]:]).any()  # rows past the local experts are exact zeros


@pytest.mark.parametrize("group", [32, 64, 128, 256, None])
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_the_k_tile_holds_whole_groups_at_real_model_widths(backend, group):
    for k in (576, 768, 896, 1536, 2048, 3072, 4096, 4864, 11008, 14336, 18944):
        if group and k % group:
            continue
        for m in (1, 300):
            plan = select_kernel(KernelProblem("int4_weight_matmul", m, k, 4096, "bfloat16", group_size=group),
                                 backend)
            assert plan.fallback_reason is None and plan.tile_table is not None
            assert plan.tiling.tk % (group or 1) == 0
            assert plan.tiling.tk % (256 if backend == "tpu" else 32) == 0


def test_tilings_that_cut_a_group_are_refused():
    problem = KernelProblem("int4_weight_matmul", 8, 1024, 256, group_size=128)
    with pytest.raises(KernelArgumentError, match="multiple of 256"):
        select_kernel(problem, "tpu", Tiling(16, 128, 128))
    with pytest.raises(KernelArgumentError, match="multiple of 128"):
        select_kernel(problem, "gpu", Tiling(16, 64, 32))


def test_argument_errors_name_what_is_wrong():
    x = np.ones((2, 96), np.float32)
    codes = np.zeros((8, 96), np.int8)
    with pytest.raises(KernelArgumentError, match="not a multiple of group_size=64"):
        int4_weight_matmul(x, codes, np.ones((8, 2), np.float32), group_size=64)
    with pytest.raises(KernelArgumentError, match=r"needs \[8, 3\]"):
        int4_weight_matmul(x, codes, np.ones((8, 2), np.float32), group_size=32)
    with pytest.raises(KernelArgumentError, match="w_codes must be int8"):
        int4_weight_matmul(x, codes.astype(np.uint8), np.ones((8, 3), np.float32), group_size=32)
    with pytest.raises(KernelArgumentError, match="one scale per output channel"):
        int4_weight_matmul(x, codes, np.ones((8, 3), np.float32), group_size=None)


def test_a_group_size_the_kernels_do_not_decode_falls_back_with_a_reason():
    rng = np.random.default_rng(5)
    codes, scale, weight = int4_weight(rng, 128, 96, group=16)
    x = rng.normal(size=(3, 96)).astype(np.float32)
    y, plan = int4_weight_matmul(x, codes, scale, group_size=16, backend="cpu", return_plan=True)
    assert plan.is_reference and "not 16" in plan.fallback_reason
    assert_close_to_f64(y, x.astype(np.float64) @ weight.astype(np.float64).T, 96)


def test_auto_on_a_cpu_host_runs_the_reference_compiled():
    rng = np.random.default_rng(6)
    codes, scale, weight = int4_weight(rng, 64, 256, group=128)
    x = rng.normal(size=(4, 256)).astype(np.float32)
    y, plan = int4_weight_matmul(x, codes, scale, group_size=128, return_plan=True)
    assert plan.backend == "xla" and plan.name == "int4_weight_matmul_xla"
    assert_close_to_f64(y, x.astype(np.float64) @ weight.astype(np.float64).T, 256)


def test_qlinear_routes_an_int4_qarray_to_the_w4a16_kernel():
    rng = np.random.default_rng(7)
    codes, scale, weight = int4_weight(rng, 128, 512, group=128)
    q = QArray(codes, scale, kind="int4", block_size=128, shape=(128, 512), dtype="float32")
    x = rng.normal(size=(2, 3, 512)).astype(np.float32)
    bias = rng.normal(size=128).astype(np.float32)
    y, plan = qlinear(x, q, bias, backend="cpu", return_plan=True)
    assert y.shape == (2, 3, 128) and plan.name == "int4_weight_matmul_mosaic"
    assert_close_to_f64(y.reshape(6, 128), x.reshape(6, 512).astype(np.float64) @ weight.astype(np.float64).T + bias,
                        512)
    with pytest.raises(KernelArgumentError, match="float activations"):  # act="dynamic" is W4A8-FP8 (test_w4a8.py)
        qlinear(x, q, act="static", input_scale=1.0)


def test_qgrouped_linear_stacks_int4_experts():
    rng = np.random.default_rng(8)
    experts = [int4_weight(rng, 128, 256, group=None) for _ in range(3)]
    qs = [QArray(c, s, kind="int4", shape=(128, 256), dtype="float32") for c, s, _ in experts]
    stacked = stack_experts(qs)
    assert (stacked.kind, stacked.shape, stacked.scale.shape) == ("int4", (3, 128, 256), (3, 128, 1))
    sizes = np.array([4, 0, 5], np.int32)
    x = rng.normal(size=(10, 256)).astype(np.float32)
    y, plan = qgrouped_linear(x, qs, sizes, backend="cpu", return_plan=True)
    assert plan.name == "grouped_matmul_mosaic"
    assert_close_to_f64(y, grouped_expected(x.astype(np.float64), [w.astype(np.float64) for _, _, w in experts],
                                            sizes), 256)
    with pytest.raises(KernelArgumentError, match="float activations"):  # act="dynamic" is W4A8-FP8 (test_w4a8.py)
        qgrouped_linear(x, qs, sizes, act="static", input_scales=[1.0, 1.0, 1.0])
