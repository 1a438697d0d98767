"""Dense quantized matmul kernels (W8A8, W8A16, NF4) in TPU interpret mode, and the Triton
kernels' bodies in generic interpret mode, against independent numpy references."""

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

from ops_helpers import int8_operands, nf4_weight, numpy_w8a8
from qconvert.kernels import (int8_matmul, int8_matmul_reference, int8_weight_matmul, nf4_matmul,
                              quantize_activations)
from qconvert.kernels import gpu_dense
from qconvert.kernels.dense import nf4_operands
from qconvert.kernels.plan import KernelProblem, select_kernel
from qconvert.kernels.tiles import Tiling, pad2d, round_up

RNG = np.random.default_rng(1234)


def test_quantize_activations_per_token_rounds_half_to_even_hand_worked():
    # Row absmax 127 gives scale 1, so codes are round-half-even of the values themselves.
    x = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    x_q, x_scale = quantize_activations(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(x_q), [[0, 2, 2, 0, -2, 127], [0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(x_scale), [1.0, 1.0])
    assert x_q.dtype == jnp.int8


def test_quantize_activations_static_clamps_to_127():
    x = np.array([[1.0, -3.0, 0.26]], np.float32)
    x_q, x_scale = quantize_activations(jnp.asarray(x), scale=0.01)
    np.testing.assert_array_equal(np.asarray(x_q), [[100, -127, 26]])
    assert x_scale.shape == (1,) and float(x_scale[0]) == np.float32(0.01)


def test_quantize_activations_per_token_matches_numpy():
    x = RNG.normal(size=(5, 33)).astype(np.float32)
    x_q, x_scale = quantize_activations(jnp.asarray(x))
    scale = np.abs(x).max(axis=1) / np.float32(127)
    np.testing.assert_array_equal(np.asarray(x_scale), scale)
    np.testing.assert_array_equal(np.asarray(x_q), np.clip(np.round(x / scale[:, None]), -127, 127))


@pytest.mark.parametrize("m,k,n", [(1, 128, 128), (37, 200, 150)])
def test_int8_matmul_is_bit_exact_and_follows_the_rescale_order(m, k, n):
    x_q, w_q, x_scale, w_scale = int8_operands(m, k, n, RNG)
    y = int8_matmul(x_q, w_q, x_scale, w_scale, backend="cpu")
    np.testing.assert_array_equal(np.asarray(y), numpy_w8a8(x_q, w_q, x_scale, w_scale))


def test_int8_matmul_int32_accumulator_is_exact_at_the_extremes():
    # 127 * 127 * 1024 = 16.5M: past float32's exact integers, well inside int32.
    x_q = np.full((8, 1024), 127, np.int8)
    w_q = np.full((128, 1024), -127, np.int8)
    ones_m, ones_n = np.ones(8, np.float32), np.ones(128, np.float32)
    y = int8_matmul(x_q, w_q, ones_m, ones_n, out_dtype=jnp.float32, backend="cpu")
    assert float(y[0, 0]) == np.float32(-127 * 127 * 1024)


def test_int8_matmul_with_bias_matches_reference_bits_and_is_deterministic():
    x_q, w_q, x_scale, w_scale = int8_operands(19, 160, 130, RNG)
    bias = RNG.normal(size=130).astype(np.float32)
    first = int8_matmul(x_q, w_q, x_scale, w_scale, bias=bias, backend="cpu")
    second = int8_matmul(x_q, w_q, x_scale, w_scale, bias=bias, backend="cpu")
    ref = int8_matmul_reference(x_q, w_q, x_scale, w_scale, bias=bias)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(ref))
    assert np.asarray(first).tobytes() == np.asarray(second).tobytes()
    # and the bias really is added: within one float32 rounding of the numpy sum
    np.testing.assert_allclose(np.asarray(first), numpy_w8a8(x_q, w_q, x_scale, w_scale) + bias, rtol=1e-6,
                               atol=1e-6)


def test_int8_matmul_per_tensor_scale_and_bf16_output():
    x_q, w_q, _, w_scale = int8_operands(9, 128, 128, RNG)
    y = int8_matmul(x_q, w_q, np.array([0.02], np.float32), w_scale, out_dtype=jnp.bfloat16, backend="cpu")
    assert y.dtype == jnp.bfloat16
    expected = numpy_w8a8(x_q, w_q, np.full(9, 0.02, np.float32), w_scale)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.asarray(expected).astype(jnp.bfloat16)))


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_int8_weight_matmul_matches_float64_dequantized_product(x_dtype):
    m, k, n = 13, 200, 140
    x = jnp.asarray(RNG.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    _, w_q, _, w_scale = int8_operands(m, k, n, RNG)
    bias = RNG.normal(size=n).astype(np.float32)
    y = int8_weight_matmul(x, w_q, w_scale, bias=bias, out_dtype=jnp.float32, backend="cpu")
    expected = np.asarray(x.astype(jnp.float32), np.float64) @ (w_q.astype(np.float64) * w_scale[:, None]).T + bias
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m,k,n", [(1, 64, 128), (5, 192, 130), (1, 4096, 128)])
def test_nf4_matmul_matches_float64_table_decode(m, k, n):
    packed, absmax, weight = nf4_weight(n, k, RNG)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    y = nf4_matmul(x, packed, absmax, shape=(n, k), backend="cpu")
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ weight.T, rtol=2e-5, atol=2e-4 * np.sqrt(k))


@pytest.mark.parametrize("k", [576, 768, 2816])
def test_nf4_matmul_tpu_kernel_is_right_when_its_k_tile_is_an_odd_multiple_of_256(k):
    # K = 576 pads to one K tile of 768 (384 bytes: three 128-byte lane widths);
    # the decode loop must cover the last, half-size chunk of such a tile too.
    m, n = 3, 128
    packed, absmax, weight = nf4_weight(n, k, RNG)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    y, plan = nf4_matmul(x, packed, absmax, shape=(n, k), backend="cpu", return_plan=True)
    assert plan.name == "nf4_matmul_mosaic" and (plan.tiling.tk // 256) % 2 == 1
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ weight.T, rtol=2e-5, atol=2e-4 * np.sqrt(k))


def test_nf4_matmul_bf16_activations_and_output_with_bias():
    m, k, n = 16, 256, 128
    packed, absmax, weight = nf4_weight(n, k, RNG)
    x = jnp.asarray(RNG.normal(size=(m, k)).astype(np.float32)).astype(jnp.bfloat16)
    bias = RNG.normal(size=n).astype(np.float32)
    y = nf4_matmul(x, packed, absmax, shape=(n, k), bias=bias, out_dtype=jnp.bfloat16, backend="cpu")
    assert y.dtype == jnp.bfloat16
    # the kernel casts the decoded weight to bf16, as bitsandbytes does for a bf16 compute dtype
    w_bf16 = np.asarray(jnp.asarray(weight.astype(np.float32)).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    expected = np.asarray(x.astype(jnp.float32), np.float64) @ w_bf16.T + bias
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), expected, rtol=1e-2, atol=1e-2)


def test_nf4_matmul_decodes_bitsandbytes_own_quantization():
    torch = pytest.importorskip("torch")
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(96, 192, generator=torch.Generator().manual_seed(0))
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    dequantized = bnb_functional.dequantize_4bit(packed, state).numpy().astype(np.float64)
    x = RNG.normal(size=(7, 192)).astype(np.float32)
    y = nf4_matmul(x, packed.numpy(), state.absmax.numpy(), shape=(96, 192), backend="cpu")
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ dequantized.T, rtol=2e-5, atol=2e-3)


def test_nf4_matmul_with_k_not_a_block_multiple_falls_back_with_a_reason():
    m, k, n = 3, 100, 7  # blocks of 64 straddle rows
    packed, absmax, weight = nf4_weight(n, k, RNG)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    y, plan = nf4_matmul(x, packed, absmax, shape=(n, k), backend="cpu", return_plan=True)
    assert plan.is_reference and "multiple of the NF4 block size" in plan.fallback_reason
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ weight.T, rtol=1e-5, atol=1e-4)


def _triton_interpret(op, m, k, n, *operands, out_dtype=jnp.float32):
    """Run a Triton kernel body through Pallas' generic interpreter at the GPU plan's tiling."""
    plan = select_kernel(KernelProblem(op, m, k, n), "gpu")
    t = plan.tiling
    mp, np_ = round_up(m, t.tm), round_up(n, t.tn)
    kp = round_up(k, t.tk)
    return plan, mp, kp, np_


def test_triton_int8_kernel_body_is_bit_exact_in_interpret_mode():
    m, k, n = 20, 300, 70
    x_q, w_q, x_scale, w_scale = int8_operands(m, k, n, RNG)
    plan, mp, kp, np_ = _triton_interpret("int8_matmul", m, k, n)
    y = gpu_dense.int8_matmul_gpu(
        pad2d(jnp.asarray(x_q), mp, kp), pad2d(jnp.asarray(w_q), np_, kp), pad2d(jnp.asarray(x_scale)[:, None], mp, 1),
        pad2d(jnp.asarray(w_scale)[None, :], 1, np_), jnp.zeros((1, np_)), tiling=plan.tiling,
        out_dtype=jnp.float32, has_bias=False, interpret=True)
    np.testing.assert_array_equal(np.asarray(y[:m, :n]), numpy_w8a8(x_q, w_q, x_scale, w_scale))


def test_triton_nf4_and_w8a16_kernel_bodies_match_in_interpret_mode():
    m, k, n = 3, 192, 40
    packed, absmax, weight = nf4_weight(n, k, RNG)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    plan, mp, kp, np_ = _triton_interpret("nf4_matmul", m, k, n)
    ops = nf4_operands(x, packed, absmax, n, k, mp, kp, np_)
    y = gpu_dense.nf4_matmul_gpu(*ops, jnp.zeros((1, np_)), tiling=plan.tiling, out_dtype=jnp.float32,
                                 has_bias=False, interpret=True)
    np.testing.assert_allclose(np.asarray(y[:m, :n]), x.astype(np.float64) @ weight.T, rtol=2e-5, atol=2e-3)

    _, w_q, _, w_scale = int8_operands(m, k, n, RNG)
    plan, mp, kp, np_ = _triton_interpret("int8_weight_matmul", m, k, n)
    y = gpu_dense.int8_weight_matmul_gpu(
        pad2d(jnp.asarray(x), mp, kp), pad2d(jnp.asarray(w_q), np_, kp), pad2d(jnp.asarray(w_scale)[None, :], 1, np_),
        jnp.zeros((1, np_)), tiling=plan.tiling, out_dtype=jnp.float32, has_bias=False, interpret=True)
    expected = x.astype(np.float64) @ (w_q.astype(np.float64) * w_scale[:, None]).T
    np.testing.assert_allclose(np.asarray(y[:m, :n]), expected, rtol=1e-5, atol=1e-4)


# A fixed tiling keeps the padded kernel shapes (and so the compiled kernels) few.
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 256), n=st.integers(1, 256), seed=st.integers(0, 2**16))
def test_int8_matmul_property_bit_exact_on_random_shapes(m, k, n, seed):
    x_q, w_q, x_scale, w_scale = int8_operands(m, k, n, np.random.default_rng(seed))
    y = int8_matmul(x_q, w_q, x_scale, w_scale, backend="cpu", tiling=Tiling(32, 128, 128))
    np.testing.assert_array_equal(np.asarray(y), numpy_w8a8(x_q, w_q, x_scale, w_scale))


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 16), blocks=st.integers(1, 6), n=st.integers(1, 128), seed=st.integers(0, 2**16))
def test_nf4_matmul_property_matches_table_decode(m, blocks, n, seed):
    rng = np.random.default_rng(seed)
    k = 64 * blocks
    packed, absmax, weight = nf4_weight(n, k, rng)
    x = rng.normal(size=(m, k)).astype(np.float32)
    y = nf4_matmul(x, packed, absmax, shape=(n, k), backend="cpu")
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ weight.T, rtol=2e-5, atol=2e-3)
