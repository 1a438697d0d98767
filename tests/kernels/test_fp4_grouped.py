"""The FP4 grouped (MoE) kernels (NVFP4A16: E2M1 in groups of 16, E4M3 scales over a float32 global scale per
expert; MXFP4A16: groups of 32, power-of-two scales) in TPU interpret mode, as Triton kernel bodies in Pallas'
generic interpreter (tiled and GEMV), and as the jnp reference, against a float64 numpy decode of the E2M1 table
at the widths of a real MoE (Qwen3-30B-A3B: hidden 2048, expert width 768), with ragged and empty experts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qconvert.kernels import KernelArgumentError, Variant, fp4_grouped_matmul, fp4_grouped_matmul_reference
from qconvert.kernels.qlinear import qgrouped_linear
from qconvert.schemes.fp4 import quantize_mxfp4, quantize_nvfp4

from ops_helpers import group_bounds, numpy_grouped

RNG = np.random.default_rng(530)
# E2M1 by hand: sign bit 3, magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)], np.float64)
# Rows per expert of a layer of 8 experts: two empty (one inside the run of rows), one of a single row; the
# 70 rows hold 64 of them, so 6 rows past the last group must come out zero.
SIZES = np.array([9, 0, 17, 1, 12, 0, 21, 4], np.int32)
M = 70


def fp4_experts(g: int, n: int, k: int, group: int, nvfp4: bool):
    """Random codes, scales as the format holds them (E4M3 values and one global scale per expert, or powers of
    two) and the float32 weights [G, N, K] they stand for, decoded in numpy: E2M1[code] * f32(scale / global)."""
    codes = RNG.integers(0, 16, (g, n, k)).astype(np.uint8)
    if nvfp4:
        scale = RNG.uniform(0.02, 448.0, (g, n, k // group)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        w_global = (448.0 * 6.0 / RNG.uniform(0.05, 2.0, g)).astype(np.float32)  # each expert's own
        effective = scale / w_global[:, None, None]  # float32 / float32: one IEEE rounding
    else:
        scale = np.exp2(RNG.integers(-9, 2, (g, n, k // group))).astype(np.float32)
        w_global, effective = None, scale
    weight = (E2M1[codes] * np.repeat(effective.astype(np.float64), group, axis=-1)).astype(np.float32)
    return codes, scale, w_global, weight


def float64_grouped(x, weight, sizes, offset=0, x_dtype=np.float32):
    """Each row times its expert's W^T in float64, W cast to the activation dtype first (the contract)."""
    return numpy_grouped(x, [w.astype(x_dtype).astype(np.float64).T for w in weight], sizes, offset)


def assert_close(y, want, k: int):
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


# Qwen3-30B-A3B's experts: gate/up [768, 2048] (K = hidden 2048) and down [2048, 768] (K = expert width 768).
REAL = [(2048, 768, 16, True), (768, 2048, 32, False)]


@pytest.mark.parametrize("k, n, group, nvfp4", REAL)
def test_tpu_kernel_matches_float64_at_real_k(k, n, group, nvfp4):
    codes, scale, w_global, weight = fp4_experts(len(SIZES), n, k, group, nvfp4)
    x = RNG.normal(size=(M, k)).astype(np.float32)
    y, plan = fp4_grouped_matmul(x, codes, scale, jnp.asarray(SIZES), group_size=group, w_global=w_global,
                                 backend="cpu", return_plan=True)
    assert plan.name == "grouped_matmul_mosaic" and plan.interpret and plan.fallback_reason is None
    assert plan.tiling.tk % group == 0  # K tiles hold whole groups
    assert_close(y, float64_grouped(x, weight, SIZES), k)
    assert not np.asarray(y)[SIZES.sum():].any()  # rows past the last expert: exact zeros


@pytest.mark.parametrize("k, n, group, nvfp4", [(2048, 768, 32, False), (768, 2048, 16, True)])
def test_triton_kernel_body_matches_float64_at_real_k(triton_interpreted, k, n, group, nvfp4):
    codes, scale, w_global, weight = fp4_experts(len(SIZES), n, k, group, nvfp4)
    x = RNG.normal(size=(M, k)).astype(np.float32)
    y, plan = fp4_grouped_matmul(x, codes, scale, jnp.asarray(SIZES), group_size=group, w_global=w_global,
                                 backend="gpu", return_plan=True)
    assert plan.name == "grouped_matmul_triton" and plan.variant is None and plan.fallback_reason is None
    assert_close(y, float64_grouped(x, weight, SIZES), k)
    assert not np.asarray(y)[SIZES.sum():].any()



@pytest.mark.parametrize("group, nvfp4", [(16, True), (32, False)])
def test_triton_gemv_variant_at_decode_on_a_shard_of_experts(grouped_gemv_interpreted, group, nvfp4):
    # decode: 11 rows over 6 experts, 4 of them local (from expert 1); expert 2 empty, rows 9-10 past every group
    sizes = np.array([2, 3, 0, 2, 2, 0], np.int32)
    k, n = 2048, 64
    codes, scale, w_global, weight = fp4_experts(4, n, k, group, nvfp4)
    x = RNG.normal(size=(11, k)).astype(np.float32)
    y, plan = fp4_grouped_matmul(x, codes, scale, jnp.asarray(sizes), group_size=group, w_global=w_global,
                                 group_offset=1, backend="gpu", tiling=(16, 256, 32),
                                 variant=Variant("gemv", split=2), return_plan=True)
    assert plan.variant.name == "gemv"
    assert_close(y, float64_grouped(x, weight, sizes, offset=1), k)
    assert not np.asarray(y)[:2].any() and not np.asarray(y)[9:].any()  # rows of no local expert


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("group, nvfp4", [(16, True), (32, False)])
def test_the_reference_matches_float64_at_real_k(backend, group, nvfp4):
    k, n = 2048, 96
    codes, scale, w_global, weight = fp4_experts(len(SIZES), n, k, group, nvfp4)
    x = RNG.normal(size=(M, k)).astype(np.float32)
    y, plan = fp4_grouped_matmul(x, codes, scale, jnp.asarray(SIZES), group_size=group, w_global=w_global,
                                 backend=backend, return_plan=True)
    assert plan.is_reference
    want = float64_grouped(x, weight, SIZES)
    assert_close(y, want, k)
    direct = fp4_grouped_matmul_reference(x, codes, scale, jnp.asarray(SIZES), group_size=group, w_global=w_global)
    assert_close(direct, want, k)


def test_bf16_activations_and_output_on_a_shard():
    sizes = np.array([3, 5, 0, 6], np.int32)
    k, n, group = 512, 136, 16
    codes, scale, w_global, weight = fp4_experts(2, n, k, group, nvfp4=True)  # experts 1 and 2 of 4
    x = RNG.normal(size=(16, k)).astype(ml_dtypes.bfloat16)
    y = fp4_grouped_matmul(jnp.asarray(x), codes, scale, jnp.asarray(sizes), group_size=group, w_global=w_global,
                           group_offset=1, preferred_element_type=jnp.bfloat16, backend="cpu")
    assert y.dtype == jnp.bfloat16
    want = float64_grouped(x, weight, sizes, offset=1, x_dtype=ml_dtypes.bfloat16)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    b = group_bounds(sizes)
    assert not np.asarray(y, np.float32)[:b[1]].any() and not np.asarray(y, np.float32)[b[3]:].any()


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_hand_worked_codes_each_expert_over_its_own_global_scale(backend):
    # two experts of one row each, one group of 16: codes 0..15 are +0 .. 6 and -0 .. -6; the group scale 448
    # over global scales 224 and 56 makes 2 and 8
    codes = np.broadcast_to(np.arange(16, dtype=np.uint8), (2, 1, 16)).copy()
    scale = np.full((2, 1, 1), 448.0, np.float32)
    x = np.zeros((2, 16), np.float32)
    x[:, :8] = 1.0  # the positive half: 0 + 0.5 + 1 + 1.5 + 2 + 3 + 4 + 6 = 18, times 2 = 36
    x[1, 9] = 2.0  # expert 1's row also meets code 9 (-0.5) twice: 18 - 1 = 17, times 8 = 136
    y = fp4_grouped_matmul(x, codes, scale, jnp.array([1, 1], jnp.int32), group_size=16,
                           w_global=np.array([224.0, 56.0], np.float32), backend=backend)
    assert np.asarray(y).ravel().tolist() == [36.0, 136.0]


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_mxfp4])
@pytest.mark.parametrize("backend, name", [("cpu", "grouped_matmul_mosaic"), ("xla", "grouped_matmul_xla")])
def test_qgrouped_linear_routes_fp4_experts_to_the_grouped_kernels(quantize, backend, name, monkeypatch):
    from qconvert.kernels import tpu_grouped

    decoded = []
    tile_dot = tpu_grouped.fp4_tile_dot
    monkeypatch.setattr(tpu_grouped, "fp4_tile_dot", lambda *a, **kw: decoded.append(1) or tile_dot(*a, **kw))
    jax.clear_caches()
    sizes = np.array([4, 0, 7], np.int32)
    qs = [quantize(RNG.normal(size=(48, 256)).astype(np.float32)) for _ in sizes]
    x = RNG.normal(size=(11, 256)).astype(np.float32)
    y, plan = qgrouped_linear(x, qs, sizes, backend=backend, return_plan=True)
    assert plan.name == name and y.shape == (11, 48)
    assert bool(decoded) == (backend == "cpu")  # the Mosaic kernel decoded E2M1 itself
    weights = []
    for q in qs:  # the QArrays decoded in numpy: E2M1[code] * f32(scale / global), each its own global
        effective = np.asarray(q.scale, np.float32)
        if q.zero_point is not None:
            effective = effective / np.asarray(q.zero_point, np.float32).reshape(())
        weights.append((E2M1[np.asarray(q.qvalue)] * np.repeat(effective.astype(np.float64), q.block_size, 1)).T)
    np.testing.assert_allclose(np.asarray(y), numpy_grouped(x, weights, sizes), rtol=1e-5, atol=1e-4)


def test_fp4_experts_with_activations_are_refused():
    q = quantize_mxfp4(np.ones((8, 64), np.float32))
    with pytest.raises(KernelArgumentError, match="FP4 experts take float activations"):
        qgrouped_linear(np.ones((2, 64), np.float32), [q], [2], act="dynamic", backend="cpu")


def test_other_group_sizes_run_the_reference_and_say_why():
    codes, scale, _, weight = fp4_experts(2, 8, 128, 64, nvfp4=False)
    x = RNG.normal(size=(5, 128)).astype(np.float32)
    sizes = np.array([2, 3], np.int32)
    y, plan = fp4_grouped_matmul(x, codes, scale, jnp.asarray(sizes), group_size=64, backend="cpu",
                                 return_plan=True)
    assert plan.is_reference and "groups of 16 or 32" in plan.fallback_reason
    assert_close(y, float64_grouped(x, weight, sizes), 128)


@pytest.mark.parametrize("change, message", [
    (dict(w_codes=np.zeros((2, 8, 64), np.int8)), "codes must be uint8"),
    (dict(w_codes=np.zeros((8, 64), np.uint8)), "codes must be [G, N, K]"),
    (dict(w_scale=np.ones((2, 8, 3), np.float32)), "need (2, 8, 4)"),
    (dict(group_size=24), "not a whole number of groups of 24"),
    (dict(w_global=np.ones((3,), np.float32)), "one float32 per expert (2)"),
])
def test_bad_arguments_are_refused_in_one_line(change, message):
    args = dict(w_codes=np.zeros((2, 8, 64), np.uint8), w_scale=np.ones((2, 8, 4), np.float32), group_size=16,
                w_global=None)
    args.update(change)
    codes, scale = args.pop("w_codes"), args.pop("w_scale")
    with pytest.raises(KernelArgumentError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        fp4_grouped_matmul(np.ones((2, 64), np.float32), codes, scale, jnp.array([1, 1], jnp.int32), backend="cpu",
                           **args)
