"""Fidelity: what a quantized linear must compute, from the folder's own dequantized weights, without the kernels.

The kernel a deployment runs is checked against this, not against the float
layer: any difference here is the kernel's (a wrong tile, decode or rescale),
whatever the quantization itself costs. The arithmetic follows the scheme's
deployment contract, in float64 from the stored tensors (numpy, and XLA's float64
dot for the products):

  int8 (W8A16)  x in the model's float dtype  @  (code * weight_scale)^T  + bias
  w8a8          x in the model's float dtype, int8 per token (scale max|x| / 127,
                float32) or per tensor (input_scale), round half to even, clamp
                to +-127; codes @ codes^T (exact), * x_scale * weight_scale + bias
  int4 (W4A16)  x in the model's float dtype  @  (code * its group's weight_scale)^T  + bias
  nf4           x in the model's float dtype @ (NF4 level * absmax, in the model's
                float dtype)^T + bias
  w4a8-fp8      x in the model's float dtype, E4M3 per token as fp8's (scale max|x| / 448,
                float32); the E4M3 values @ (code * its group's weight_scale)^T, * x_scale + bias
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
import numpy as np

from qconvert.formats import QArray
from qconvert.schemes import scheme_named

# (name, x [M, in] float32, QArray, bias or None) -> y [M, out] float64
FolderLinear = Callable[[str, np.ndarray, QArray, object], np.ndarray]


def _model_dtype(q: QArray) -> np.dtype:
    dtype = np.dtype(q.dtype)
    return dtype if dtype.kind in "fV" else np.dtype(np.float32)


@jax.jit
def _matmul_nt_f64(a, b):
    return jnp.matmul(a, b.T, precision=jax.lax.Precision.HIGHEST)


def matmul_nt_f64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b.T in float64, by XLA's own threads (a threaded BLAS stalls on a busy host)."""
    with jax.enable_x64(True):
        return np.asarray(_matmul_nt_f64(np.asarray(a, np.float64), np.asarray(b, np.float64)))


def folder_linear_output(x: np.ndarray, q: QArray, bias, scheme: str,
                         input_scale: float | None = None) -> np.ndarray:
    """The layer as the folder's tensors define it (float64 [M, out]); see the module docstring."""
    x = np.asarray(x).astype(_model_dtype(q)).astype(np.float64)
    folder_scheme = scheme_named(scheme)
    if folder_scheme.act_modes:
        # The weight as the folder defines it (per-channel or group scales), times the quantized activations.
        codes, x_scale = folder_scheme.folder_activations(x, input_scale)
        y = matmul_nt_f64(codes, folder_scheme.folder_weight(q)) * x_scale
    else:
        y = matmul_nt_f64(x, folder_scheme.folder_weight(q))
    if bias is not None:
        y = y + np.asarray(bias, np.float32).astype(np.float64)[None, :]
    return y


def make_folder_linear(quantized, scheme: str) -> FolderLinear:
    """A FolderLinear over a QuantizedCheckpoint (static input scales read from the folder)."""

    def folder_linear(name: str, x: np.ndarray, q: QArray, bias) -> np.ndarray:
        return folder_linear_output(x, q, bias, scheme, quantized.input_scale(name))

    return folder_linear
