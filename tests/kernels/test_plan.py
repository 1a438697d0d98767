"""Kernel selection and argument checks: what is chosen, why it falls back, and the errors for bad input."""

import numpy as np
import jax.numpy as jnp
import pytest

from qconvert.kernels.errors import KernelArgumentError
from qconvert.formats import QArray
from qconvert.kernels import (KernelProblem, grouped_matmul, int8_matmul, nf4_matmul, qlinear, quantize_activations,
                              select_kernel)
from qconvert.kernels.plan import CPU_INTERPRET_MAX_STEPS
from qconvert.kernels.tiles import Tiling


def test_plan_reports_kernel_backend_tiling_and_guarantee():
    plan = select_kernel(KernelProblem("int8_matmul", 1, 4096, 4096), backend="tpu")
    assert (plan.name, plan.backend, plan.interpret) == ("int8_matmul_mosaic", "tpu", False)
    assert plan.tiling.tm % 32 == 0 and plan.tiling.tn % 128 == 0
    assert "bit-identical" in plan.guarantee and plan.fallback_reason is None
    assert "int8_matmul_mosaic on tpu [tm=" in plan.describe()
    gpu = select_kernel(KernelProblem("nf4_matmul", 1, 4096, 4096), backend="gpu")
    # decode: one row tile, narrow N blocks, four whole 64-blocks per K step
    assert gpu.name == "nf4_matmul_triton" and gpu.tiling == Tiling(16, 256, 32) and gpu.tile_table == "gpu/decode"


def test_plan_on_cpu_falls_back_for_large_grids_and_says_why():
    plan = select_kernel(KernelProblem("int8_matmul", 4096, 4096, 4096), backend="cpu")
    assert plan.is_reference and str(CPU_INTERPRET_MAX_STEPS) in plan.fallback_reason
    assert "fell back" in plan.describe()


def test_unknown_backend_and_bad_tilings_are_rejected():
    with pytest.raises(KernelArgumentError, match="unknown kernel backend"):
        select_kernel(KernelProblem("int8_matmul", 8, 128, 128), backend="metal")
    with pytest.raises(KernelArgumentError, match="tn % 128"):
        select_kernel(KernelProblem("int8_matmul", 8, 128, 128), backend="tpu", tiling=(32, 128, 100))
    with pytest.raises(KernelArgumentError, match="powers of two"):
        select_kernel(KernelProblem("int8_matmul", 8, 128, 128), backend="gpu", tiling=(16, 96, 64))


def test_reference_backend_is_honoured():
    x_q = np.ones((2, 3), np.int8)
    y, plan = int8_matmul(x_q, x_q, np.ones(2, np.float32), np.full(2, 0.5, np.float32), backend="reference",
                          return_plan=True)
    assert plan.is_reference and plan.fallback_reason is None
    np.testing.assert_array_equal(np.asarray(y), np.full((2, 2), 1.5, np.float32))


@pytest.mark.parametrize("args,match", [
    ((np.ones((2, 4), np.float32), np.ones((3, 4), np.int8), np.ones(2), np.ones(3)), "x_q must be int8"),
    ((np.ones((2, 4), np.int8), np.ones((4, 3), np.int8), np.ones(2), np.ones(3)), "nn.Linear layout"),
    ((np.ones((2, 4, 1), np.int8), np.ones((3, 4), np.int8), np.ones(2), np.ones(3)), "rank 2"),
    ((np.ones((2, 4), np.int8), np.ones((3, 4), np.int8), np.ones(5), np.ones(3)), "per token"),
    ((np.ones((2, 4), np.int8), np.ones((3, 4), np.int8), np.ones(2), np.ones(4)), "per output channel"),
])
def test_int8_matmul_argument_errors(args, match):
    with pytest.raises(KernelArgumentError, match=match):
        int8_matmul(*args, backend="reference")


def test_nf4_matmul_layout_errors():
    x = np.ones((2, 128), np.float32)
    with pytest.raises(KernelArgumentError, match="uint8"):
        nf4_matmul(x, np.zeros(64 * 64, np.int8), np.ones(128, np.float32), shape=(64, 128))
    with pytest.raises(KernelArgumentError, match="packs into"):
        nf4_matmul(x, np.zeros(100, np.uint8), np.ones(128, np.float32), shape=(64, 128))
    with pytest.raises(KernelArgumentError, match="absmax"):
        nf4_matmul(x, np.zeros(64 * 64, np.uint8), np.ones(3, np.float32), shape=(64, 128))
    with pytest.raises(KernelArgumentError, match="K=64"):
        nf4_matmul(np.ones((2, 64), np.float32), np.zeros(64 * 64, np.uint8), np.ones(128, np.float32),
                   shape=(64, 128))


def test_grouped_and_activation_argument_errors():
    with pytest.raises(KernelArgumentError, match="group_sizes must be int32"):
        grouped_matmul(np.ones((4, 8), np.float32), np.ones((2, 8, 8), np.float32), np.array([2, 2], np.int64))
    with pytest.raises(KernelArgumentError, match="rhs_scale"):
        grouped_matmul(np.ones((4, 8), np.float32), np.ones((2, 8, 8), np.int8), jnp.array([2, 2], jnp.int32))
    with pytest.raises(KernelArgumentError, match="group_offset"):
        grouped_matmul(np.ones((4, 8), np.float32), np.ones((2, 8, 8), np.float32), jnp.array([2, 2], jnp.int32),
                       group_offset=1)
    with pytest.raises(KernelArgumentError, match="rank 2"):
        quantize_activations(np.ones((2, 3, 4), np.float32))


def test_qlinear_routes_int8_and_nf4_qarrays():
    rng = np.random.default_rng(3)
    codes = rng.integers(-127, 128, (128, 64)).astype(np.int8)
    scale = rng.uniform(0.01, 0.02, (128, 1)).astype(np.float32)
    q = QArray(codes, scale, kind="int8", shape=(128, 64), dtype="float32")
    x = rng.normal(size=(2, 3, 64)).astype(np.float32)
    w = codes.astype(np.float64) * scale
    y, plan = qlinear(x, q, backend="reference", return_plan=True)
    assert y.shape == (2, 3, 128) and plan.op == "int8_weight_matmul"
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    y, plan = qlinear(x, q, act="dynamic", backend="reference", return_plan=True)
    assert plan.op == "int8_matmul"
    rows = x.reshape(6, 64)
    x_scale = np.abs(rows).max(axis=1, keepdims=True) / np.float32(127)
    x_q = np.clip(np.round(rows / x_scale), -127, 127)
    expected = (x_q @ codes.T.astype(np.float64)) * x_scale * scale.T
    np.testing.assert_allclose(np.asarray(y).reshape(6, 128), expected, rtol=1e-5, atol=1e-5)
    nf4 = QArray(np.full(64 * 64, 0xF7, np.uint8), np.full(128, 2.0, np.float32), kind="nf4", block_size=64,
                 shape=(64, 128), dtype="float32")
    y = qlinear(np.ones((1, 128), np.float32), nf4, backend="reference")
    # every even column decodes to level 15 (1.0) and every odd to level 7 (0.0), times absmax 2
    np.testing.assert_allclose(np.asarray(y), np.full((1, 64), 128.0))
    with pytest.raises(KernelArgumentError, match="input_scale"):
        qlinear(x, q, act="static")
