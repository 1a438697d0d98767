"""Triton grouped (MoE) matmul kernels: bodies run in Pallas' generic interpreter through the GPU
dispatch against per-group numpy products and the pure-jnp references, their tile -> group
map, and their lowering for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qconvert.formats import NF4_LEVELS, QArray
from qconvert.kernels import (KernelProblem, grouped_matmul, grouped_matmul_reference, select_kernel,
                              transposed_grouped_matmul, transposed_grouped_matmul_reference)
from qconvert.kernels import gpu_grouped
from qconvert.kernels.tiles import Tiling

from ops_helpers import group_bounds, numpy_grouped

RNG = np.random.default_rng(11)
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def test_tile_group_map_hand_worked():
    # rows: g0 0-2, g1 empty, g2 3-7, g3 8-15; tiles of 4 rows
    sizes = jnp.array([3, 0, 5, 8], jnp.int32)
    offsets = gpu_grouped.local_group_offsets(sizes, 0, 4)
    first, count = gpu_grouped.tile_group_map(offsets, 16, 4)
    np.testing.assert_array_equal(np.asarray(offsets), [0, 3, 3, 8, 16])
    # tile 0 holds g0 and g2 with the empty g1 between them; the kernel skips g1's K walk
    np.testing.assert_array_equal(np.asarray(first), [0, 2, 3, 3])
    np.testing.assert_array_equal(np.asarray(count), [3, 1, 1, 1])
    # only expert 2 is local (a shard): it covers tiles 0 and 1; tiles 2 and 3 hold none of its rows
    offsets = gpu_grouped.local_group_offsets(sizes, 2, 1)
    first, count = gpu_grouped.tile_group_map(offsets, 16, 4)
    np.testing.assert_array_equal(np.asarray(offsets), [3, 8])
    np.testing.assert_array_equal(np.asarray(first)[:2], [0, 0])
    np.testing.assert_array_equal(np.asarray(count), [1, 1, 0, 0])


def test_plan_picks_the_triton_kernels_on_gpu():
    plan = select_kernel(KernelProblem("grouped_matmul", 512, 4096, 14336, num_groups=8, rhs_kind="nf4"), "gpu")
    assert (plan.name, plan.backend, plan.fallback_reason) == ("grouped_matmul_triton", "gpu", None)
    # a prefill tile that decodes two whole NF4 blocks per K step, named after its table
    assert plan.tiling == Tiling(64, 128, 128) and plan.tile_table == "gpu/prefill"
    assert "grouped_matmul_triton on gpu [tm=64 tk=128 tn=128; gpu/prefill tiles]" == plan.describe()
    plan = select_kernel(KernelProblem("transposed_grouped_matmul", 4096, 4096, 14336, num_groups=8), "gpu")
    assert (plan.name, plan.fallback_reason) == ("transposed_grouped_matmul_triton", None)
    assert all(t >= 16 and t & (t - 1) == 0 for t in (plan.tiling.tm, plan.tiling.tk, plan.tiling.tn))


def test_float_rhs_with_empty_and_unaligned_groups(triton_interpreted):
    sizes = np.array([10, 0, 13, 5], np.int32)  # 28 of 30 rows used; 16-row tiles straddle groups
    lhs = RNG.normal(size=(30, 100)).astype(np.float32)
    rhs = RNG.normal(size=(4, 100, 130)).astype(np.float32)
    y, plan = grouped_matmul(lhs, rhs, jnp.asarray(sizes), tiling=(16, 32, 64), backend="gpu", return_plan=True)
    assert (plan.name, plan.backend, plan.tiling) == ("grouped_matmul_triton", "gpu", Tiling(16, 32, 64))
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, rhs.astype(np.float64), sizes), rtol=1e-5,
                               atol=1e-4)
    assert not np.asarray(y[28:]).any()  # rows past sum(group_sizes) are exact zeros


def test_sharded_experts_with_group_offset_transposed_rhs_bf16_output(triton_interpreted):
    sizes = np.array([7, 9, 6, 8], np.int32)
    lhs = RNG.normal(size=(30, 64)).astype(np.float32)
    rhs_nk = RNG.normal(size=(2, 40, 64)).astype(np.float32)  # experts 1 and 2, nn.Linear layout
    y, plan = grouped_matmul(lhs, rhs_nk, jnp.asarray(sizes), group_offset=1, transpose_rhs=True,
                             preferred_element_type=jnp.bfloat16, backend="gpu", return_plan=True)
    assert plan.name == "grouped_matmul_triton" and y.dtype == jnp.bfloat16
    expected = numpy_grouped(lhs, [w.T.astype(np.float64) for w in rhs_nk], sizes, offset=1)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), expected, rtol=1e-2, atol=2e-2)
    b = group_bounds(sizes)
    assert not np.asarray(y[:b[1]]).any() and not np.asarray(y[b[3]:]).any()  # other experts' rows


def test_int8_per_channel_rhs_in_the_k_n_layout(triton_interpreted):
    sizes = np.array([5, 0, 12], np.int32)
    lhs = RNG.normal(size=(17, 96)).astype(np.float32)
    codes = RNG.integers(-127, 128, (3, 96, 50)).astype(np.int8)  # [G, K, N]
    scale = RNG.uniform(0.001, 0.02, (3, 50)).astype(np.float32)
    y, plan = grouped_matmul(lhs, codes, jnp.asarray(sizes), rhs_scale=scale, tiling=(16, 32, 32), backend="gpu",
                             return_plan=True)
    assert plan.name == "grouped_matmul_triton"
    weights = [codes[g].astype(np.float64) * scale[g][None, :] for g in range(3)]
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, weights, sizes), rtol=1e-5, atol=1e-4)


def test_nf4_qarray_rhs_decoded_in_kernel_with_group_offset(triton_interpreted):
    g, n, k = 2, 48, 128  # two 64-blocks per row; N not a multiple of the tile
    codes = RNG.integers(0, 16, g * n * k)
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    absmax = RNG.uniform(0.1, 1.0, g * n * k // 64).astype(np.float32)
    dense = (NF4_LEVELS[codes].astype(np.float64) * np.repeat(absmax, 64)).reshape(g, n, k)
    q = QArray(packed, absmax, kind="nf4", block_size=64, shape=(g, n, k), dtype="float32")
    sizes = np.array([4, 9, 0, 6], np.int32)  # experts 1 and 2 are local; expert 2 is empty
    lhs = RNG.normal(size=(21, k)).astype(np.float32)
    y, plan = grouped_matmul(lhs, q, jnp.asarray(sizes), transpose_rhs=True, group_offset=1, backend="gpu",
                             return_plan=True)
    # one K step decodes both 64-blocks of every row
    assert plan.name == "grouped_matmul_triton" and plan.tiling.tk == 128
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, [w.T for w in dense], sizes, offset=1),
                               rtol=1e-5, atol=1e-3)


def test_transposed_grouped_matmul_zeroes_empty_groups_with_offset(triton_interpreted):
    sizes = np.array([3, 40, 0, 50, 27], np.int32)
    lhs = RNG.normal(size=(24, 125)).astype(np.float32)  # [K, M], M > sum: the last rows are in no group
    rhs = RNG.normal(size=(125, 70)).astype(np.float32)  # [M, N]
    y, plan = transposed_grouped_matmul(lhs, rhs, jnp.asarray(sizes), group_offset=1, num_actual_groups=3,
                                        tiling=(32, 16, 64), backend="gpu", return_plan=True)
    assert (plan.name, plan.backend) == ("transposed_grouped_matmul_triton", "gpu")
    b = group_bounds(sizes)
    expected = np.stack([lhs[:, b[g]:b[g + 1]].astype(np.float64) @ rhs[b[g]:b[g + 1]] for g in (1, 2, 3)])
    assert y.shape == (3, 24, 70)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)
    assert not np.asarray(y[1]).any()


# Fixed shapes and tiling keep the interpreted kernel compiled once; group sizes are runtime values.
@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(0, 40), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_property_random_group_sizes_match_the_jnp_references(cuts, seed):
    rng = np.random.default_rng(seed)
    edges = np.sort(np.array(cuts + [40]))  # 4 groups over at most 40 rows, empty ones included
    sizes = np.diff(np.concatenate([[0], edges])).astype(np.int32)
    lhs = rng.normal(size=(40, 48)).astype(np.float32)
    rhs = rng.normal(size=(4, 48, 24)).astype(np.float32)
    grad = rng.normal(size=(40, 24)).astype(np.float32)
    with pytest.MonkeyPatch.context() as patch:  # hypothesis re-runs the body; a function fixture would not
        for name in ("grouped_matmul_gpu", "transposed_grouped_matmul_gpu"):
            patch.setattr(gpu_grouped, name, functools.partial(getattr(gpu_grouped, name), interpret=True))
        y = grouped_matmul(lhs, rhs, jnp.asarray(sizes), tiling=(16, 16, 32), backend="gpu")
        dw = transposed_grouped_matmul(lhs.T, grad, jnp.asarray(sizes), tiling=(16, 16, 32), backend="gpu")
    np.testing.assert_allclose(np.asarray(y), np.asarray(grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes))),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(lhs, rhs.astype(np.float64), sizes), rtol=1e-5,
                               atol=1e-4)
    expected_dw = transposed_grouped_matmul_reference(lhs.T, grad, jnp.asarray(sizes))
    np.testing.assert_allclose(np.asarray(dw), np.asarray(expected_dw), rtol=1e-5, atol=1e-4)
    b = group_bounds(sizes)
    for g in range(4):  # and each group's weight gradient against numpy, zeros for an empty group
        np.testing.assert_allclose(np.asarray(dw[g]), lhs.T[:, b[g]:b[g + 1]].astype(np.float64) @ grad[b[g]:b[g + 1]],
                                   rtol=1e-5, atol=1e-4)


def lowered_text(fn, args, **static):
    return jax.jit(functools.partial(fn, **static)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rhs_kind,transpose_rhs,x_dtype", [
    ("float", False, jnp.bfloat16), ("float", True, jnp.float32), ("int8", False, jnp.bfloat16),
    ("int8", True, jnp.bfloat16), ("nf4", True, jnp.bfloat16), ("nf4", True, jnp.float32),
    ("int4", True, jnp.bfloat16), ("int4", True, jnp.float32)])
def test_grouped_matmul_lowers_to_a_triton_call_for_cuda(rhs_kind, transpose_rhs, x_dtype):
    # 8 experts at a decode-like tiling; K and G deliberately not powers of two
    tables = (S((7,), I32), S((6,), I32), S((6,), I32))
    if rhs_kind == "nf4":
        lhs = (S((96, 384), x_dtype),) * 2
        rhs = (S((6, 256, 384), jnp.uint8), S((6, 256, 12), jnp.float32))
    elif rhs_kind == "int4":  # K 768 in groups of 32: two groups per K step of 64
        lhs = (S((96, 384), x_dtype),) * 2
        rhs = (S((6, 256, 384), jnp.int8), S((6, 256, 24), jnp.float32))
    else:
        lhs = (S((96, 768), x_dtype),)
        dtype = jnp.int8 if rhs_kind == "int8" else jnp.bfloat16
        rhs = (S((6, 256, 768) if transpose_rhs else (6, 768, 256), dtype),)
        if rhs_kind == "int8":
            rhs += (S((6, 256), jnp.float32),)
    tiling = Tiling(16, 64, 32) if rhs_kind in ("nf4", "int4") else Tiling(16, 64, 64)
    text = lowered_text(gpu_grouped.grouped_matmul_gpu, (*tables, lhs, rhs), tiling=tiling, out_dtype=jnp.bfloat16,
                        rhs_kind=rhs_kind, transpose_rhs=transpose_rhs, interpret=False)
    assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_transposed_grouped_matmul_lowers_to_a_triton_call_for_cuda(out_dtype):
    text = lowered_text(gpu_grouped.transposed_grouped_matmul_gpu,
                        (S((9,), I32), S((256, 384), jnp.bfloat16), S((384, 256), jnp.bfloat16)),
                        tiling=Tiling(64, 64, 128), out_dtype=out_dtype, interpret=False)
    assert "__gpu$xla.gpu.triton" in text
