"""`--scheme fp8`: FP8 E4M3 weights per output channel and FP8 activations per token at run time (FP8_DYNAMIC).

Written in compressed-tensors `float-quantized`, which vLLM serves on GPU and
vLLM TPU on its torchax path. The quantization is compressed-tensors' own,
byte for byte: per output row, scale = absmax / 448 (E4M3's largest finite
value) in the weight's dtype, a zero scale replaced by that dtype's eps, and
code = float8_e4m3fn(w / scale), round-to-nearest-even, clamped to +-448, the
quotient taken in the weight's dtype as torch takes it (the float32 quotient,
rounded once more). There is no calibration: the server quantizes each token's
activations at run time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_fp8 import FloatQuantizedFP8
from qconvert.formats.qarray import QArray
from qconvert.formats.quotient import f32_quotient
from qconvert.schemes.rowwise import all_finite_hint, quantize_per_row
from qconvert.schemes.base import ClipSearch, Scheme, SearchResult, Thresholds
from qconvert.schemes.grids import FloatGrid
from qconvert.schemes.int4 import in_dtype

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP8_CLIP_GRID = tuple(round(1.0 - 0.01 * k, 4) for k in range(21))  # 1.00 .. 0.80, as int8's


@functools.partial(jax.jit, static_argnames=("scale_dtype",))
def fp8_codes_and_scales(w: jax.Array, scale_dtype, clip: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Codes float8_e4m3fn [rows, cols], scales [rows, 1] in scale_dtype, and a finite hint.

    `clip` (float32 [rows, 1], optional) shrinks each row's absmax first (a
    searched ratio); values beyond it saturate at +-448. Call inside `x64()`.
    """
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    scale = in_dtype(f32_quotient(absmax, jnp.float32(FP8_MAX)), scale_dtype)
    scale = jnp.where(scale == 0, jnp.float32(jnp.finfo(scale_dtype).eps), scale)
    quotient = in_dtype(f32_quotient(w.astype(jnp.float32), scale), w.dtype)
    # compressed-tensors adds its (zero) zero point before the cast, which turns -0 into +0.
    quotient = jnp.where(quotient == 0, jnp.float32(0), quotient)
    codes = jnp.clip(quotient, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return codes, scale.astype(scale_dtype), all_finite_hint(w)


def quantize_fp8(w, *, scale_dtype=None, clip=None) -> QArray:
    """FP8 E4M3 of a [out, in] weight with one scale per output row; scale_dtype defaults to w's dtype.

    Rows go through the kernel in chunks (rowwise.quantize_per_row). InvalidWeightError for NaN/Inf.
    """
    return quantize_per_row(w, fp8_codes_and_scales, ml_dtypes.float8_e4m3fn, "fp8", scale_dtype=scale_dtype,
                            clip=clip)


@jax.jit
def _row_errors(w: jax.Array, grid: jax.Array) -> jax.Array:
    """[ratios, rows] squared weight error of each row with scale = c * absmax / 448."""
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / FP8_MAX, 1e-12)
        codes = jnp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        return jnp.sum((w - codes * scale) ** 2, axis=1)

    return jax.lax.map(one, grid)


def fp8_clip_search(w: np.ndarray, grid: tuple[float, ...] = FP8_CLIP_GRID) -> SearchResult:
    """Per output row, the absmax ratio c minimising the row's squared weight error.

    A float code's error is relative, so clipping gains little (only rows whose
    small values fall into E4M3's subnormals); ratio 1 wins ties.
    """
    errors = np.asarray(_row_errors(jnp.asarray(np.asarray(w, np.float32)), jnp.asarray(grid, jnp.float32)),
                        np.float64)
    best = np.argmin(errors, axis=0)  # the first minimum: the largest ratio
    chosen = np.take_along_axis(errors, best[None], axis=0)[0]
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()), float(chosen.sum()))


class FP8(Scheme):
    """FP8 E4M3 codes with one scale per output row; activations quantized to FP8 per token at run time."""

    name = "fp8"
    layout = FloatQuantizedFP8()
    act_modes = ("dynamic",)
    clip = ClipSearch(FP8_CLIP_GRID, "per output channel: scale = c * absmax / 448")
    # E4M3 keeps 3 mantissa bits: each value is off by at most 2**-4 of itself (about 30 dB SQNR on a
    # weight, whatever its range), and activations are rounded the same way per token, so a layer lands
    # near w8a8's dynamic quality (int8 has a finer step for Gaussian weights but is outlier-bound); w8a8's
    # dynamic thresholds apply. Fidelity keeps the default 60 dB: the kernel and the folder's float64
    # weight see the same fp8 activations.
    thresholds = Thresholds(
        min_layer_sqnr_db=20.0, min_layer_cosine=0.99, max_mean_kl=0.05,
        min_top1_agreement=0.80, max_perplexity_ratio=1.10, min_pooled_cosine=0.98,
    )

    def check_options(self, *, act: str, double_quant: bool, group_size, calibrates: bool) -> None:
        # Neither vLLM nor vLLM TPU is recorded accepting static fp8 activation scales from this layout,
        # and there is nothing to calibrate without them.
        if act == "static":
            raise UsageError("--scheme fp8 quantizes activations per token at run time; --act static (a "
                             "calibrated per-tensor scale) is not written for it: drop --act static")
        super().check_options(act=act, double_quant=double_quant, group_size=group_size, calibrates=calibrates)

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_fp8(weight, scale_dtype=scale_dtype, clip=clip)

    def gptq_grid(self):
        return FloatGrid(FP8_MAX)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return fp8_clip_search(weight)

    def folder_activations(self, x: np.ndarray, input_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
        # Per token: scale = max|x| / 448 (float32; 1 for a zero row), codes = e4m3(x / scale), round to
        # nearest even, saturated at +-448; each e4m3 value is exact in float64.
        xf = x.astype(np.float32)
        absmax = np.abs(xf).max(axis=1, keepdims=True)
        scale = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
        codes = np.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return codes.astype(np.float64), scale.astype(np.float64)

    def folder_weight(self, q: QArray) -> np.ndarray:
        """The e4m3 values (each exact in float64) times their row's scale."""
        return np.asarray(q.qvalue, np.float64) * np.asarray(q.scale, np.float64).reshape(q.shape[0], 1)
