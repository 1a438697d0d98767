"""FP8 (E4M3) W8A8 kernels, dense and grouped (MoE), against independent float64 numpy products built on
ml_dtypes.float8_e4m3fn: the TPU kernels in TPU interpret mode (backend "cpu"), the Triton kernels in Pallas'
generic interpreter (backend "gpu").

The contract in numpy (compressed-tensors' FP8_DYNAMIC, as vLLM runs it): each
activation row quantized to E4M3 with scale absmax / 448 (float32), the code
sum in float64 times x_scale[m] * w_scale[n], plus bias. The kernels accumulate
exact E4M3 products in float32, hence the tolerance. K runs to 14336 with M and
N kept small.
"""

import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from qconvert.formats import QArray
from qconvert.kernels import (KernelArgumentError, fp8_matmul, grouped_matmul, qgrouped_linear, qlinear,
                              quantize_fp8_activations, select_kernel, stack_experts)
from qconvert.kernels.plan import KernelProblem
from qconvert.kernels.tiles import Tiling

from ops_helpers import group_bounds

BF16 = jnp.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def numpy_fp8_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 codes, float32 scales) of each row of x: scale absmax / 448 (1 for a zero row), codes
    x / scale saturated at +-448 and rounded to nearest even by ml_dtypes."""
    x = np.asarray(x, np.float32)
    absmax = np.abs(x).max(axis=-1)
    scale = np.where(absmax > 0, absmax / np.float32(448), np.float32(1)).astype(np.float32)
    codes = np.clip(x / scale[..., None], -448, 448).astype(E4M3)
    return codes, scale


def fp8_weight(rng, *shape):
    """A random weight's E4M3 codes [..., N, K], float32 scales [..., N, 1] and its float64 value."""
    w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.01, 1.0, (*shape[:-1], 1)).astype(np.float32)
    codes, scale = numpy_fp8_rows(w)
    return codes, scale[..., None], codes.astype(np.float64) * scale[..., None].astype(np.float64)


def as_f32_values(x, dtype) -> np.ndarray:
    """x rounded to the activation dtype, as float32 (what the quantizer reads)."""
    x = np.asarray(x, np.float32)
    return x.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == BF16 else x


def assert_close_to_f64(y, expected, k, out_dtype=jnp.float32):
    # float32 accumulation over K exact products; a wrong scale, row or dropped K tile is off by far more
    y = np.asarray(jnp.asarray(y).astype(jnp.float32))
    assert y.shape == expected.shape
    scale = np.abs(expected).max()
    if out_dtype == BF16:
        np.testing.assert_allclose(y, expected, rtol=1e-2, atol=1e-2 * scale)
    else:
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * np.sqrt(k) * scale / 10 + 1e-6)


def test_activation_quantizer_matches_ml_dtypes_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 4096)).astype(np.float32) * rng.uniform(1e-3, 1e3, (7, 1)).astype(np.float32)
    x[3] = 0.0
    x_q, x_scale = quantize_fp8_activations(x)
    codes, scale = numpy_fp8_rows(x)
    assert x_q.dtype == jnp.float8_e4m3fn and x_scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(x_scale), scale)
    np.testing.assert_array_equal(np.asarray(x_q).view(np.uint8), codes.view(np.uint8))
    assert x_scale[3] == 1.0 and not np.asarray(x_q[3].astype(jnp.float32)).any()


def test_activation_quantizer_hand_worked_rounding_and_saturation():
    # E4M3 steps by 1/8 in [1, 2): 1.0625 ties to 1.0 (even), 1.1875 to 1.25 (even), 1.19 up to 1.25;
    # 500 saturates to 448 (never NaN: E4M3 has no infinity); 2**-10 is below half the smallest subnormal
    x = np.array([[1.0625, 1.1875, 1.19, -500.0, 2.0 ** -10, 0.0]], np.float32)
    x_q, x_scale = quantize_fp8_activations(x, scale=1.0)
    assert x_scale.shape == (1,)
    np.testing.assert_array_equal(np.asarray(x_q.astype(jnp.float32)), [[1.0, 1.25, 1.25, -448.0, 0.0, 0.0]])


# (backend, m, k, n, bias, out dtype): K up to 14336, M of one row, an odd count, and more rows than the
# largest row tile (256 TPU, 128 GPU); N a tile multiple or not.
DENSE_CASES = [
    ("cpu", 1, 14336, 128, True, jnp.float32),
    ("cpu", 7, 4864, 200, False, BF16),
    ("cpu", 261, 576, 200, True, jnp.float32),
    ("gpu", 1, 14336, 128, False, jnp.float32),
    ("gpu", 7, 3584, 200, True, jnp.float32),
    ("gpu", 261, 896, 128, True, BF16),
]


@pytest.mark.parametrize("backend,m,k,n,with_bias,out_dtype", DENSE_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}{'-bias' if c[4] else ''}-{jnp.dtype(c[5]).name}"
                              for c in DENSE_CASES])
def test_fp8_matmul_matches_float64_product_of_the_codes(backend, m, k, n, with_bias, out_dtype, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k + m)
    w_codes, w_scale, _ = fp8_weight(rng, n, k)
    x_codes, x_scale = numpy_fp8_rows(rng.normal(size=(m, k)))
    bias = rng.normal(size=n).astype(np.float32) if with_bias else None
    y, plan = fp8_matmul(x_codes, w_codes, x_scale, w_scale, bias=bias, out_dtype=out_dtype, backend=backend,
                         return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend and plan.op == "fp8_matmul", plan.describe()
    assert y.dtype == out_dtype
    expected = (x_codes.astype(np.float64) @ w_codes.astype(np.float64).T) * x_scale[:, None] * w_scale.T
    assert_close_to_f64(y, expected + (0 if bias is None else bias), k, out_dtype)


@pytest.mark.parametrize("backend,x_dtype", [("cpu", BF16), ("cpu", jnp.float32), ("gpu", BF16), ("xla", BF16)])
def test_qlinear_quantizes_activations_per_token_to_e4m3(backend, x_dtype, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(3)
    k, n = 3072, 128
    w_codes, w_scale, weight = fp8_weight(rng, n, k)
    q = QArray(w_codes, w_scale, kind="fp8", shape=(n, k), dtype=jnp.dtype(x_dtype).name)
    x = jnp.asarray(rng.normal(size=(2, 3, k)).astype(np.float32)).astype(x_dtype)
    bias = rng.normal(size=n).astype(np.float32)
    y, plan = qlinear(x, q, bias, act="dynamic", out_dtype=jnp.float32, backend=backend, return_plan=True)
    assert y.shape == (2, 3, n) and plan.op == "fp8_matmul" and plan.fallback_reason is None
    x_codes, x_scale = numpy_fp8_rows(as_f32_values(x, x_dtype).reshape(6, k))
    expected = (x_codes.astype(np.float64) * x_scale[:, None]) @ weight.T + bias
    assert_close_to_f64(y.reshape(6, n), expected, k)


def test_qlinear_refuses_an_fp8_weight_without_activation_quantization():
    q = QArray(np.zeros((8, 64), E4M3), np.ones((8, 1), np.float32), kind="fp8", shape=(8, 64))
    with pytest.raises(KernelArgumentError, match="act='dynamic'"):
        qlinear(np.ones((2, 64), np.float32), q)


def test_the_dequantized_fp8_qarray_is_code_times_scale():
    rng = np.random.default_rng(4)
    codes, scale, weight = fp8_weight(rng, 16, 96)
    q = QArray(codes, scale, kind="fp8", shape=(16, 96), dtype="float32")
    assert q.kind.float_codes and q.kind.channel_scaled and not q.kind.int8
    np.testing.assert_allclose(np.asarray(q.dequantize()), weight, rtol=1e-7)


def grouped_expected(x, weights, sizes, offset=0):
    """weights[l] is group (l + offset)'s float64 [N, K]; rows of other groups are 0."""
    bounds = group_bounds(sizes)
    out = np.zeros((x.shape[0], weights[0].shape[0]))
    for local, w in enumerate(weights):
        g = local + offset
        out[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]] @ w.T
    return out


# (backend, m, k, n, x dtype, group sizes, group offset): empty groups, uneven groups, rows past the groups,
# and a shard of the experts (two local experts of four, from expert 1).
GROUPED_CASES = [
    ("cpu", 5, 14336, 128, BF16, (2, 0, 3), 0),
    ("cpu", 261, 768, 128, jnp.float32, (3, 130, 0, 100), 1),
    ("gpu", 5, 14336, 128, BF16, (2, 0, 3), 0),
    ("gpu", 19, 4864, 200, jnp.float32, (11, 0, 5), 0),
    ("gpu", 261, 768, 128, jnp.float32, (3, 130, 0, 100), 1),
]


@pytest.mark.parametrize("backend,m,k,n,x_dtype,sizes,offset", GROUPED_CASES,
                         ids=[f"{c[0]}-m{c[1]}-k{c[2]}-n{c[3]}-{jnp.dtype(c[4]).name}" for c in GROUPED_CASES])
def test_grouped_fp8_experts_match_per_group_float64_products(backend, m, k, n, x_dtype, sizes, offset, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k + 7 * m)
    local = len(sizes) if offset == 0 else 2
    codes, scale, weight = fp8_weight(rng, local, n, k)
    q = QArray(codes, scale, kind="fp8", shape=(local, n, k), dtype=jnp.dtype(x_dtype).name)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(x_dtype)
    sizes = np.array(sizes, np.int32)
    y, plan = grouped_matmul(x, q, jnp.asarray(sizes), transpose_rhs=True, group_offset=offset, backend=backend,
                             return_plan=True)
    assert plan.fallback_reason is None and plan.backend == backend
    expected = grouped_expected(as_f32_values(x, x_dtype).astype(np.float64), list(weight), sizes, offset)
    assert_close_to_f64(y, expected, k)
    bounds = group_bounds(sizes)
    assert not np.asarray(y[bounds[offset + local]:]).any()  # rows past the local experts are exact zeros


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_qgrouped_linear_runs_fp8_experts_on_e4m3_rows(backend, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(8)
    k, n = 576, 128
    experts = [fp8_weight(rng, n, k) for _ in range(3)]
    qs = [QArray(c, s, kind="fp8", shape=(n, k), dtype="float32") for c, s, _ in experts]
    stacked = stack_experts(qs)
    assert (stacked.kind, stacked.shape, stacked.scale.shape) == ("fp8", (3, n, k), (3, n, 1))
    sizes = np.array([4, 0, 5], np.int32)
    x = rng.normal(size=(10, k)).astype(np.float32)
    y, plan = qgrouped_linear(x, qs, sizes, act="dynamic", backend=backend, return_plan=True)
    assert plan.op == "grouped_matmul" and plan.fallback_reason is None
    x_codes, x_scale = numpy_fp8_rows(x)
    rows = x_codes.astype(np.float64) * x_scale[:, None]
    assert_close_to_f64(y, grouped_expected(rows, [w for _, _, w in experts], sizes), k)
    with pytest.raises(KernelArgumentError, match="act='dynamic'"):
        qgrouped_linear(x, qs, sizes)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_fp8_tiles_fit_their_backend_at_real_model_widths(backend):
    for k in (576, 768, 896, 1536, 2048, 3072, 3584, 4096, 4864, 11008, 14336, 18944):
        for m in (1, 300):
            plan = select_kernel(KernelProblem("fp8_matmul", m, k, 4096, "float8_e4m3fn"), backend)
            assert plan.fallback_reason is None and plan.tile_table is not None
            t = plan.tiling
            if backend == "gpu":
                assert t.tk >= 32 and all(v & (v - 1) == 0 for v in (t.tm, t.tk, t.tn))
            else:
                assert t.tm % 32 == 0 and t.tk % 128 == 0 and t.tn % 128 == 0


def test_tilings_the_fp8_kernels_cannot_run_are_refused():
    problem = KernelProblem("fp8_matmul", 8, 1024, 256, "float8_e4m3fn")
    with pytest.raises(KernelArgumentError, match="tk >= 32"):
        select_kernel(problem, "gpu", Tiling(16, 16, 32))
    with pytest.raises(KernelArgumentError, match="tm % 32"):
        select_kernel(problem, "tpu", Tiling(16, 512, 128))


def test_argument_errors_name_what_is_wrong():
    x = np.zeros((2, 64), E4M3)
    w = np.zeros((8, 64), E4M3)
    with pytest.raises(KernelArgumentError, match="x_q must be float8_e4m3fn"):
        fp8_matmul(x.astype(np.int8), w, np.ones(2, np.float32), np.ones(8, np.float32))
    with pytest.raises(KernelArgumentError, match="w_q has K=32"):
        fp8_matmul(x, w[:, :32], np.ones(2, np.float32), np.ones(8, np.float32))
    with pytest.raises(KernelArgumentError, match="per output channel"):
        fp8_matmul(x, w, np.ones(2, np.float32), np.ones(4, np.float32))


def test_auto_on_a_cpu_host_runs_the_reference_compiled():
    rng = np.random.default_rng(6)
    w_codes, w_scale, _ = fp8_weight(rng, 64, 256)
    x_codes, x_scale = numpy_fp8_rows(rng.normal(size=(4, 256)))
    y, plan = fp8_matmul(x_codes, w_codes, x_scale, w_scale, return_plan=True)
    assert plan.backend == "xla" and plan.name == "fp8_matmul_xla"
    expected = (x_codes.astype(np.float64) @ w_codes.astype(np.float64).T) * x_scale[:, None] * w_scale.T
    assert_close_to_f64(y, expected, 256)
