"""Grouped (MoE) matmuls in TPU interpret mode against per-group numpy products, and their metadata."""

import numpy as np
import jax.numpy as jnp

from qconvert.formats import NF4_LEVELS, QArray
from qconvert.kernels import grouped_matmul, make_group_metadata, transposed_grouped_matmul

from ops_helpers import group_bounds, numpy_grouped

RNG = np.random.default_rng(7)


def test_make_group_metadata_hand_worked():
    # rows: g0 0-2, g1 empty, g2 3-7, g3 8-15; tiles of 4 rows
    (offsets, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=jnp.array([3, 0, 5, 8], jnp.int32), m=16, tm=4, start_group=0, num_nonzero_groups=4,
        visit_empty_groups=False)
    np.testing.assert_array_equal(np.asarray(offsets), [0, 3, 3, 8, 16])
    assert int(num_tiles) == 5
    np.testing.assert_array_equal(np.asarray(group_ids)[:5], [0, 2, 2, 3, 3])
    np.testing.assert_array_equal(np.asarray(m_tile_ids)[:5], [0, 0, 1, 2, 3])
    assert group_ids.shape == (4 + 4,)


def test_make_group_metadata_visits_empty_groups_and_honours_start_group():
    sizes = jnp.array([3, 0, 5, 8], jnp.int32)
    (_, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=sizes, m=16, tm=4, start_group=0, num_nonzero_groups=4, visit_empty_groups=True)
    assert int(num_tiles) == 6
    np.testing.assert_array_equal(np.asarray(group_ids)[:6], [0, 1, 2, 2, 3, 3])
    (_, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=sizes, m=16, tm=4, start_group=2, num_nonzero_groups=1, visit_empty_groups=False)
    assert int(num_tiles) == 2
    np.testing.assert_array_equal(np.asarray(m_tile_ids)[:2], [0, 1])


def test_grouped_matmul_float_with_empty_and_unaligned_groups():
    sizes = np.array([10, 0, 13, 5], np.int32)  # 28 rows used of 30; tiles of 16 straddle groups
    lhs = RNG.normal(size=(30, 100)).astype(np.float32)
    rhs = RNG.normal(size=(4, 100, 130)).astype(np.float32)
    y, plan = grouped_matmul(lhs, rhs, jnp.asarray(sizes), tiling=(16, 128, 256), interpret=True, return_plan=True)
    assert plan.name == "grouped_matmul_mosaic" and plan.interpret
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, rhs.astype(np.float64), sizes), rtol=1e-5, atol=1e-4)


def test_grouped_matmul_sharded_experts_with_group_offset_and_transposed_rhs():
    sizes = np.array([7, 9, 6, 8], np.int32)
    lhs = RNG.normal(size=(30, 64)).astype(np.float32)
    rhs_nk = RNG.normal(size=(2, 128, 64)).astype(np.float32)  # experts 1 and 2, nn.Linear layout
    y = grouped_matmul(lhs, rhs_nk, jnp.asarray(sizes), group_offset=1, transpose_rhs=True, tiling=(16, 128, 128),
                       interpret=True)
    expected = numpy_grouped(lhs, [w.T.astype(np.float64) for w in rhs_nk], sizes, offset=1)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)


def test_grouped_matmul_int8_per_channel_rhs_bf16_output():
    sizes = np.array([5, 11], np.int32)
    lhs = RNG.normal(size=(16, 96)).astype(np.float32)
    codes = RNG.integers(-127, 128, (2, 128, 96)).astype(np.int8)
    scale = RNG.uniform(0.001, 0.02, (2, 128)).astype(np.float32)
    y = grouped_matmul(lhs, codes, jnp.asarray(sizes), rhs_scale=scale, transpose_rhs=True,
                       preferred_element_type=jnp.bfloat16, interpret=True)
    weights = [(codes[g].astype(np.float64) * scale[g][:, None]).T for g in range(2)]
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), numpy_grouped(lhs, weights, sizes), rtol=1e-2,
                               atol=1e-2)


def test_grouped_matmul_nf4_qarray_rhs():
    g, n, k = 2, 128, 128
    codes = RNG.integers(0, 16, g * n * k)
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    absmax = RNG.uniform(0.1, 1.0, g * n * k // 64).astype(np.float32)
    dense = (NF4_LEVELS[codes].astype(np.float64) * np.repeat(absmax, 64)).reshape(g, n, k)
    q = QArray(packed, absmax, kind="nf4", block_size=64, shape=(g, n, k), dtype="float32")
    sizes = np.array([9, 4], np.int32)
    lhs = RNG.normal(size=(13, k)).astype(np.float32)
    y, plan = grouped_matmul(lhs, q, jnp.asarray(sizes), transpose_rhs=True, interpret=True, return_plan=True)
    assert plan.name == "grouped_matmul_mosaic"
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, [w.T for w in dense], sizes), rtol=1e-5, atol=1e-3)


def test_transposed_grouped_matmul_zeroes_empty_groups():
    sizes = np.array([40, 0, 50, 30], np.int32)
    lhs = RNG.normal(size=(24, 120)).astype(np.float32)  # [K, M]
    rhs = RNG.normal(size=(120, 100)).astype(np.float32)  # [M, N]
    y = transposed_grouped_matmul(lhs, rhs, jnp.asarray(sizes), tiling=(128, 24, 128), interpret=True)
    bounds = group_bounds(sizes)
    expected = np.stack([lhs[:, bounds[g]:bounds[g + 1]].astype(np.float64) @ rhs[bounds[g]:bounds[g + 1]]
                         for g in range(4)])
    assert y.shape == (4, 24, 100)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)
    assert not np.asarray(y[1]).any()


def test_grouped_matmul_reference_backend_and_a_declining_tiling_fall_back():
    sizes = jnp.array([3, 5], jnp.int32)
    lhs = RNG.normal(size=(8, 32)).astype(np.float32)
    rhs = RNG.normal(size=(2, 32, 16)).astype(np.float32)
    y, plan = grouped_matmul(lhs, rhs, sizes, backend="reference", return_plan=True)
    assert plan.is_reference and plan.fallback_reason is None
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, rhs.astype(np.float64), np.asarray(sizes)),
                               rtol=1e-5, atol=1e-5)
    _, plan = grouped_matmul(lhs, rhs, sizes, tiling=lambda m, k, n: None, backend="cpu", return_plan=True)
    assert plan.is_reference and "tiling function" in plan.fallback_reason
