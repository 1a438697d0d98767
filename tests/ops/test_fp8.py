"""qconvert.ops on fp8 (E4M3) QArrays: an op multiplies the weight's values (code x channel scale) by the
activation as it is, so it dequantizes (the fp8 kernel, which quantizes activations, runs through qlinear);
against numpy on ml_dtypes codes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qconvert import ops
from qconvert.formats import QArray
from qconvert.ops.dispatch import DEQUANTIZE

DN = (((2,), (1,)), ((), ()))  # x [b, t, k] . w [n, k]


def fp8_qarray(w: np.ndarray) -> tuple[QArray, np.ndarray]:
    """An fp8 QArray of w [N, K] per output channel, and its float64 value (codes x scales)."""
    w = np.asarray(w, np.float32)
    scale = (np.abs(w).max(axis=1, keepdims=True) / np.float32(448)).astype(np.float32)
    codes = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return (QArray(codes, scale, kind="fp8", shape=w.shape, dtype="float32"),
            codes.astype(np.float64) * scale.astype(np.float64))


def test_dot_general_on_an_fp8_weight_dequantizes_matches_numpy_and_has_a_gradient():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 576)).astype(np.float32)
    w, w_float = fp8_qarray(rng.standard_normal((96, 576)))
    with ops.use_kernels("cpu"), ops.record_paths() as decisions:
        out = jax.jit(lambda a, b: ops.dot_general(a, b, DN))(x, w)
        grad = jax.grad(lambda a: jnp.sum(ops.dot_general(a, w, DN) ** 2))(x)
    assert decisions[0].path == DEQUANTIZE and "E4M3" in decisions[0].reason
    ref = np.einsum("btk,nk->btn", x, w_float)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grad), 2 * np.einsum("btn,nk->btk", ref, w_float), rtol=1e-4, atol=1e-3)


def test_einsum_and_a_transposed_fp8_weight_agree_with_numpy():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 128)).astype(np.float32)
    w, w_float = fp8_qarray(rng.standard_normal((16, 128)))
    out = ops.einsum("btk,nk->btn", x, w)
    np.testing.assert_allclose(np.asarray(out), np.einsum("btk,nk->btn", x, w_float), rtol=1e-5, atol=1e-5)
    w_t = ops.transpose(w, (1, 0))
    assert w_t.kind == "fp8" and w_t.qvalue.dtype == jnp.float8_e4m3fn
    out_t = ops.einsum("btk,kn->btn", x, w_t)
    np.testing.assert_allclose(np.asarray(out_t), np.einsum("btk,nk->btn", x, w_float), rtol=1e-5, atol=1e-5)
