"""The XLA contract path (verify's default on a CPU host), judged by numpy: W8A8 exactly (integer products,
then the reference's rescale order), W8A16 and NF4 within float32 summation; the Pallas kernels in
interpret mode agree with it; each layer's record says that it ran."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from cli_helpers import run as run_cli
from ops_helpers import int8_operands, nf4_weight, numpy_w8a8

from qconvert.kernels import int8_matmul, int8_weight_matmul, nf4_matmul, resolve_backend

RNG = np.random.default_rng(14)
# One linear shape per role kept small: every q/o/gate/up/down is 64x64, k/v 32x64.
TINY = dict(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=64, vocab=128)
# A 135M LLM's MLP: hidden 576 into intermediate 1536, 64 tokens.
M, K, N = 64, 576, 1536


def test_auto_on_a_cpu_host_is_the_xla_contract_path_and_says_so():
    assert resolve_backend("auto") == "xla"
    x_q, w_q, x_scale, w_scale = int8_operands(8, 256, 128, RNG)
    _, plan = int8_matmul(x_q, w_q, x_scale, w_scale, return_plan=True)
    assert (plan.name, plan.backend, plan.is_pallas, plan.interpret) == ("int8_matmul_xla", "xla", False, False)
    assert plan.fallback_reason is None and "bit-identical to the reference" in plan.guarantee


def test_w8a8_xla_path_is_numpy_exactly_and_the_interpret_kernel_bit_for_bit():
    x_q, w_q, x_scale, w_scale = int8_operands(M, K, N, RNG)
    bias = RNG.normal(size=N).astype(np.float32)
    xla = np.asarray(int8_matmul(x_q, w_q, x_scale, w_scale, bias=bias, backend="xla"))
    interpret, plan = int8_matmul(x_q, w_q, x_scale, w_scale, bias=bias, backend="cpu", return_plan=True)
    assert plan.is_pallas and plan.interpret
    np.testing.assert_array_equal(xla, np.asarray(interpret))
    # The rescale order in numpy, exactly (the bias add may fuse into a multiply-add: one rounding apart).
    no_bias = np.asarray(int8_matmul(x_q, w_q, x_scale, w_scale, backend="xla"))
    np.testing.assert_array_equal(no_bias, numpy_w8a8(x_q, w_q, x_scale, w_scale))
    np.testing.assert_allclose(xla, no_bias + bias[None, :], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_w8a16_xla_path_and_the_interpret_kernel_match_float64_numpy(dtype):
    x = jnp.asarray(RNG.normal(size=(M, K)).astype(np.float32)).astype(dtype)
    w_q = RNG.integers(-127, 128, (N, K)).astype(np.int8)
    w_scale = RNG.uniform(1e-3, 0.1, N).astype(np.float32)
    xla = np.asarray(int8_weight_matmul(x, w_q, w_scale, backend="xla"))
    interpret = np.asarray(int8_weight_matmul(x, w_q, w_scale, backend="cpu"))
    # The kernel's guarantee: float32 accumulation, summation order its own.
    want = np.asarray(x, np.float64) @ w_q.astype(np.float64).T * w_scale.astype(np.float64)[None, :]
    # float32 sums of 576 terms: within a few ulps of the largest output, whatever the order.
    tolerance = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(xla, want, rtol=0, atol=tolerance)
    np.testing.assert_allclose(interpret, xla, rtol=0, atol=tolerance)


def test_nf4_xla_path_and_the_interpret_kernel_match_float64_numpy():
    x = RNG.normal(size=(M, K)).astype(np.float32)
    packed, absmax, weight = nf4_weight(N, K, RNG)
    xla = np.asarray(nf4_matmul(x, packed, absmax, shape=(N, K), backend="xla"))
    interpret = np.asarray(nf4_matmul(x, packed, absmax, shape=(N, K), backend="cpu"))
    want = x.astype(np.float64) @ weight.T
    tolerance = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(xla, want, rtol=0, atol=tolerance)
    np.testing.assert_allclose(interpret, xla, rtol=0, atol=tolerance)


@pytest.fixture(scope="module")
def w8a8_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("xla")
    source = make_llama_checkpoint(root / "src", **TINY)
    out = root / "w8a8"
    args = ["quantize", str(source), "-o", str(out), "--scheme", "w8a8", "--quiet",
            "--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"]
    with pytest.raises(SystemExit) as exc:
        from qconvert.cli.main import main

        main(args)
    assert exc.value.code == 0
    return out


def test_default_verify_runs_the_xla_path_with_the_interpret_kernels_own_w8a8_figures(w8a8_folder, capsys):
    runs = {}
    for backend in ("auto", "cpu"):
        code, out, err = run_cli(["verify", str(w8a8_folder), "--quick", "--backend", backend, "--json", "-"],
                                 capsys)
        assert code == 0, err
        runs[backend] = json.loads(out)
    default, interpret = runs["auto"], runs["cpu"]
    assert default["backend"] == "xla" and interpret["backend"] == "cpu"
    for layer in default["layers"]:
        assert layer["kernel"]["name"] == "int8_matmul_xla" and layer["kernel"]["backend"] == "xla"
        assert not layer["kernel"]["pallas"] and not layer["kernel"]["interpret"]
    # int32 accumulation and one rescale order: the same bits, so the same figures, layer by layer.
    by_name = {layer["name"]: layer for layer in interpret["layers"]}
    for layer in default["layers"]:
        assert by_name[layer["name"]]["kernel"]["pallas"]
        assert layer["sqnr_db"] == by_name[layer["name"]]["sqnr_db"], layer["name"]
        assert layer["fidelity_sqnr_db"] == by_name[layer["name"]]["fidelity_sqnr_db"], layer["name"]
