"""The FP4 weight-only kernels (NVFP4A16: E2M1 in groups of 16, E4M3 scales over a float32 global scale;
MXFP4A16: groups of 32, power-of-two scales) in TPU interpret mode and as Triton kernel bodies in Pallas'
generic interpreter, against a float64 numpy decode of the E2M1 table, at the K of real layers."""

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qconvert.formats import QArray
from qconvert.kernels import fp4 as fp4_kernels
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.fp4 import fp4_weight_matmul
from qconvert.kernels.plan import KernelProblem, select_kernel
from qconvert.kernels.qlinear import qlinear
from qconvert.schemes.fp4 import quantize_mxfp4, quantize_nvfp4

RNG = np.random.default_rng(53)
# E2M1 by hand: sign bit 3, magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)], np.float64)


def fp4_weight(n: int, k: int, group: int, nvfp4: bool):
    """Random codes, scales as the format holds them (E4M3 values and a global scale, or powers of two), and the
    float32 weight they stand for, decoded in numpy: E2M1[code] * f32(scale / global)."""
    codes = RNG.integers(0, 16, (n, k)).astype(np.uint8)
    if nvfp4:
        scale = RNG.uniform(0.02, 448.0, (n, k // group)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        w_global = np.array([[448.0 * 6.0 / 0.37]], np.float32)
        effective = scale / w_global[0, 0]  # float32 / float32: one IEEE rounding, as compressed-tensors divides
    else:
        scale = np.exp2(RNG.integers(-9, 2, (n, k // group))).astype(np.float32)
        w_global, effective = None, scale
    weight = (E2M1[codes] * np.repeat(effective.astype(np.float64), group, axis=1)).astype(np.float32)
    return codes, scale, w_global, weight


def float64_product(x, weight, x_dtype=np.float32, bias=None):
    """x @ W^T in float64, W cast to the activation dtype first (the kernels' contract), + bias."""
    y = x.astype(np.float64) @ weight.astype(x_dtype).astype(np.float64).T
    return y if bias is None else y + bias.astype(np.float64)


@pytest.mark.parametrize("k, group, nvfp4", [(4096, 16, True), (14336, 32, False)])
def test_tpu_kernel_matches_float64_at_real_k(k, group, nvfp4):
    # K of a Llama-3-8B attention projection (4096) and of its down_proj (14336), a few rows and columns
    m, n = 3, 24
    codes, scale, w_global, weight = fp4_weight(n, k, group, nvfp4)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    y, plan = fp4_weight_matmul(x, codes, scale, group_size=group, w_global=w_global, backend="cpu",
                                return_plan=True)
    assert plan.name == "fp4_weight_matmul_mosaic" and plan.interpret and plan.fallback_reason is None
    np.testing.assert_allclose(np.asarray(y), float64_product(x, weight), rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("k, group, nvfp4", [(4096, 32, False), (14336, 16, True)])
def test_triton_kernel_body_matches_float64_at_real_k(k, group, nvfp4):
    m, n = 3, 40
    codes, scale, w_global, weight = fp4_weight(n, k, group, nvfp4)
    x = RNG.normal(size=(m, k)).astype(np.float32)
    plan = select_kernel(KernelProblem("fp4_weight_matmul", m, k, n, group_size=group), "gpu")
    assert plan.name == "fp4_weight_matmul_triton" and plan.variant is None
    # the GPU plan's own tiling and operand layout, run through Pallas' generic interpreter
    y = fp4_kernels._fp4_weight_matmul_launch(x, codes, scale, w_global, None,
                                              plan=dataclasses.replace(plan, interpret=True), group_size=group,
                                              out_dtype=jnp.dtype(jnp.float32))
    np.testing.assert_allclose(np.asarray(y), float64_product(x, weight), rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_bf16_activations_bias_and_output():
    m, k, n, group = 5, 512, 136, 16
    codes, scale, w_global, weight = fp4_weight(n, k, group, nvfp4=True)
    x = RNG.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
    bias = RNG.normal(size=(n,)).astype(np.float32)
    y = fp4_weight_matmul(jnp.asarray(x), codes, scale, group_size=group, w_global=w_global, bias=bias,
                          out_dtype=jnp.bfloat16, backend="cpu")
    assert y.dtype == jnp.bfloat16
    expected = float64_product(x, weight, ml_dtypes.bfloat16, bias)
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=1e-2, atol=2e-2 * np.abs(expected).max())


def test_hand_worked_codes_and_negative_zero():
    # one row, one group of 16: codes 0..15 are +0 .. 6 and -0 .. -6; scale 448 over a global scale of 224 = 2
    codes = np.arange(16, dtype=np.uint8)[None, :]
    x = np.ones((1, 16), np.float32)
    y = fp4_weight_matmul(x, codes, np.array([[448.0]], np.float32), group_size=16,
                          w_global=np.array([[224.0]], np.float32), backend="cpu")
    assert float(y[0, 0]) == 0.0  # each level cancels its negative
    x[0, 8:] = 0  # only the positive half: 2 * (0 + 0.5 + 1 + 1.5 + 2 + 3 + 4 + 6) = 36
    y = fp4_weight_matmul(x, codes, np.array([[448.0]], np.float32), group_size=16,
                          w_global=np.array([[224.0]], np.float32), backend="cpu")
    assert float(y[0, 0]) == 36.0


@pytest.mark.parametrize("backend, name", [("cpu", "fp4_weight_matmul_mosaic"), ("xla", "fp4_weight_matmul_xla")])
@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_mxfp4])
def test_qlinear_routes_fp4_weights_to_the_kernel_and_keeps_xla_the_reference(quantize, backend, name):
    w = RNG.normal(size=(48, 256)).astype(np.float32)
    q = quantize(w)
    x = RNG.normal(size=(2, 3, 256)).astype(np.float32)
    y, plan = qlinear(x, q, backend=backend, return_plan=True)
    assert plan.name == name and y.shape == (2, 3, 48)
    # the QArray decoded in numpy: E2M1[code] * f32(scale / global)
    effective = np.asarray(q.scale, np.float32)
    if q.zero_point is not None:
        effective = effective / np.asarray(q.zero_point, np.float32).reshape(())
    weight = E2M1[np.asarray(q.qvalue)] * np.repeat(effective.astype(np.float64), q.block_size, axis=1)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 48), x.reshape(6, 256).astype(np.float64) @ weight.T,
                               rtol=1e-5, atol=1e-4)


def test_other_group_sizes_run_the_reference_and_say_why():
    codes, scale, _, weight = fp4_weight(8, 128, 64, nvfp4=False)
    x = RNG.normal(size=(2, 128)).astype(np.float32)
    y, plan = fp4_weight_matmul(x, codes, scale, group_size=64, backend="cpu", return_plan=True)
    assert plan.is_reference and "groups of 16 or 32" in plan.fallback_reason
    np.testing.assert_allclose(np.asarray(y), float64_product(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("change, message", [
    (dict(w_codes=np.zeros((8, 64), np.int8)), "w_codes must be uint8"),
    (dict(w_scale=np.ones((8, 3), np.float32)), "needs [8, 4]"),
    (dict(group_size=24), "not a multiple of group_size=24"),
    (dict(w_global=np.ones((2,), np.float32)), "w_global must be one value"),
])
def test_bad_arguments_are_refused_in_one_line(change, message):
    args = dict(x=np.ones((2, 64), np.float32), w_codes=np.zeros((8, 64), np.uint8),
                w_scale=np.ones((8, 4), np.float32), group_size=16, w_global=None)
    args.update(change)
    x, codes, scale = args.pop("x"), args.pop("w_codes"), args.pop("w_scale")
    with pytest.raises(KernelArgumentError, match=message.replace("[", r"\[")):
        fp4_weight_matmul(x, codes, scale, backend="cpu", **args)


def test_fp4_qarray_with_activations_is_refused():
    q = QArray(np.zeros((8, 64), np.uint8), np.ones((8, 2), np.float32), kind="fp4", block_size=32, shape=(8, 64))
    with pytest.raises(KernelArgumentError, match="FP4 weights take float activations"):
        qlinear(np.ones((2, 64), np.float32), q, act="dynamic", backend="cpu")
