"""Scale searches: clipping ratios for int8 weight rows and NF4 blocks, and static activation scales.

Each search tries a fixed grid of candidates in one batched computation and
keeps, per row / block / tensor, the candidate with the least squared error
(ties go to the larger ratio, i.e. the round-to-nearest scale). Ratio 1.0 is
always on the grid, so a search never does worse than the plain absmax scale
on the data it was run on. Same input, same choice: the grids are constants
and nothing is random.

- int8 weights (per output channel): scale = c * absmax / 127; the error is the
  row's output error ||X (w - w_q)||^2 on calibration activations X, or the
  weight error ||w - w_q||^2 without activations.
- NF4 blocks: the stored absmax = c * max|block|; values beyond it clip to +-1.
- static activations: input_scale = r * max|x| / 127, the error that of the
  quantized layer's output, X_q W_q^T against X W^T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.qarray import INT8_QMAX
from qconvert.formats.quotient import int8_round
from qconvert.quantizers import pad_rows, quantize_int8

# Candidate clipping ratios, largest (plain absmax) first.
# int8: fine steps near 1 (127 levels leave little to clip), coarser below 0.95.
INT8_CLIP_GRID = (tuple(round(1.0 - 0.005 * k, 3) for k in range(10))
                  + tuple(round(0.95 - 0.025 * k, 3) for k in range(11)))      # 1.000 .. 0.70
NF4_CLIP_GRID = tuple(round(1.0 - 0.0125 * k, 4) for k in range(21))          # 1.00 .. 0.75
STATIC_RATIO_GRID = tuple(round(2.0 ** (-k / 4), 4) for k in range(17))       # 1.00 .. 0.0625
OUTPUT_ERROR_ROWS = 64  # calibration rows the int8 output-error search uses (cost: rows x in x out per ratio)
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What one search chose, and the error it reached against the plain (ratio 1) choice."""

    ratios: np.ndarray      # float32: per row, per block, or one per tensor
    error_plain: float      # summed squared error with ratio 1
    error_searched: float   # summed squared error with the chosen ratios


def _first_min(errors: jax.Array) -> jax.Array:
    # argmin over the candidate axis 0; jnp.argmin returns the first minimum, i.e. the largest ratio.
    return jnp.argmin(errors, axis=0)


@jax.jit
def _int8_row_errors(w: jax.Array, x: jax.Array, grid: jax.Array) -> jax.Array:
    """[ratios, out] squared error of each row quantized with scale = c * absmax / 127.

    x [rows, in] gives output errors; x with zero rows gives weight errors (see callers).
    """
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / INT8_QMAX, 1e-12)
        d = w - int8_round(w, scale) * scale
        return jnp.sum(jnp.matmul(x, d.T, precision=_HI) ** 2, axis=0)

    return jax.lax.map(one, grid)


@jax.jit
def _int8_row_weight_errors(w: jax.Array, grid: jax.Array) -> jax.Array:
    absmax = jnp.max(jnp.abs(w), axis=1, keepdims=True)

    def one(c):
        scale = jnp.maximum(c * absmax / INT8_QMAX, 1e-12)
        return jnp.sum((w - int8_round(w, scale) * scale) ** 2, axis=1)

    return jax.lax.map(one, grid)


def int8_clip_search(w: np.ndarray, x: np.ndarray | None = None,
                     grid: tuple[float, ...] = INT8_CLIP_GRID) -> SearchResult:
    """Per output row of w [out, in], the clipping ratio c minimising the output (or weight) error.

    With x [rows, in] (calibration activations, up to OUTPUT_ERROR_ROWS used) the
    error is ||x (w_row - w_q_row)||^2; without, ||w_row - w_q_row||^2.
    """
    w32 = jnp.asarray(np.asarray(w, np.float32))
    g = jnp.asarray(grid, jnp.float32)
    if x is not None and len(x):
        x = np.asarray(x, np.float32)
        x = x[:: max(1, len(x) // OUTPUT_ERROR_ROWS)][:OUTPUT_ERROR_ROWS]
        errors = _int8_row_errors(w32, jnp.asarray(x), g)
    else:
        errors = _int8_row_weight_errors(w32, g)
    errors = np.asarray(errors, np.float64)
    best = np.asarray(_first_min(jnp.asarray(errors)))
    rows = np.arange(errors.shape[1])
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()),
                        float(errors[best, rows].sum()))


@jax.jit
def _nf4_block_errors(blocks: jax.Array, levels: jax.Array, thresholds: jax.Array,
                      grid: jax.Array) -> jax.Array:
    """[ratios, blocks] squared error of each block with stored absmax = c * max|block|."""
    absmax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)

    def one(c):
        stored = jnp.where(absmax == 0, 1.0, c * absmax)
        codes = jnp.sum(blocks[..., None] / stored[..., None] > thresholds, axis=-1)
        return jnp.sum((blocks - levels[codes] * stored) ** 2, axis=1)

    return jax.lax.map(one, grid)


def nf4_clip_search(flat: np.ndarray, block_size: int, levels: np.ndarray, thresholds: np.ndarray,
                    grid: tuple[float, ...] = NF4_CLIP_GRID) -> SearchResult:
    """Per block of `block_size` values of the flattened weight, the absmax ratio minimising the block's error.

    The last block may be partial (zero padding changes neither its max nor its error).
    """
    flat = np.asarray(flat, np.float32).reshape(-1)
    nblocks = -(-flat.size // block_size)
    padded = np.zeros(nblocks * block_size, np.float32)
    padded[: flat.size] = flat
    blocks = padded.reshape(nblocks, block_size)
    g = jnp.asarray(grid, jnp.float32)
    lv, th = jnp.asarray(levels, jnp.float32), jnp.asarray(thresholds, jnp.float32)
    # Chunks of blocks keep the [ratios, chunk, 64, 15] comparison small.
    chunk = 4096
    errors = np.concatenate([np.asarray(_nf4_block_errors(jnp.asarray(pad_rows(blocks[s:s + chunk], chunk)),
                                                          lv, th, g))[:, : min(chunk, nblocks - s)]
                             for s in range(0, nblocks, chunk)], axis=1).astype(np.float64)
    best = np.argmin(errors, axis=0)
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()),
                        float(errors[best, np.arange(nblocks)].sum()))


@jax.jit
def _static_errors(x: jax.Array, w_q: jax.Array, y: jax.Array, scales: jax.Array) -> jax.Array:
    """[candidates] squared output error of per-tensor int8 x (each candidate scale) times w_q."""

    def one(scale):
        x_q = int8_round(x, scale) * scale
        return jnp.sum((jnp.matmul(x_q, w_q.T, precision=_HI) - y) ** 2)

    return jax.lax.map(one, scales)


def static_scale_search(x: np.ndarray, w: np.ndarray, w_dequantized: np.ndarray, tensor_absmax: float,
                        grid: tuple[float, ...] = STATIC_RATIO_GRID) -> tuple[float, SearchResult]:
    """The static input_scale = r * tensor_absmax / 127 minimising ||Q(x) W_q^T - x W^T||^2 on x [rows, in].

    `w` is the float weight the layer should compute, `w_dequantized` the
    quantized one it will compute with (both [out, in], as the linear sees x).
    Returns the scale and the search record (its ratio is a 1-element array).
    """
    x = jnp.asarray(np.asarray(x, np.float32))
    y = jnp.matmul(x, jnp.asarray(np.asarray(w, np.float32)).T, precision=_HI)
    base = np.float32(max(float(tensor_absmax), 1e-30) / INT8_QMAX)
    scales = np.asarray(grid, np.float32) * base
    errors = np.asarray(_static_errors(x, jnp.asarray(np.asarray(w_dequantized, np.float32)), y,
                                       jnp.asarray(scales)), np.float64)
    best = int(np.argmin(errors))
    return float(scales[best]), SearchResult(np.asarray([grid[best]], np.float32), float(errors[0]),
                                             float(errors[best]))


@dataclasses.dataclass(frozen=True)
class LinearSearch:
    """The searched numbers of one linear: weight clipping ratios and/or its static input scale."""

    clip: np.ndarray | None      # float32 [out], or None (plain absmax)
    input_scale: float | None    # static activations only
    record: dict                 # what qconvert.json records for it


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


def search_linear(weight: np.ndarray, x: np.ndarray | None, *, scale_dtype, clip_weights: bool,
                  static_absmax: float | None) -> LinearSearch:
    """One linear's searches on its (already smoothed) float weight [out, in] and input rows x [rows, in].

    clip_weights: search the int8 clipping ratio per row (output error on x, or
    weight error without rows). static_absmax: max|x| of the whole calibration
    (as the linear sees it); given, the static input_scale is searched on x, or
    is static_absmax / 127 without rows.
    """
    has_rows = x is not None and len(x) > 0
    record: dict = {}
    clip = None
    if clip_weights:
        found = int8_clip_search(weight, x if has_rows else None)
        clip = found.ratios
        record["weight_clip"] = {"objective": "output error" if has_rows else "weight error",
                                 "error_plain": _rounded(found.error_plain),
                                 "error_searched": _rounded(found.error_searched),
                                 "mean_ratio": _rounded(float(np.mean(clip)))}
    input_scale = None
    if static_absmax is not None:
        input_scale = float(np.float32(static_absmax) / np.float32(INT8_QMAX))
        if has_rows:
            dequantized = quantize_int8(weight, scale_dtype=scale_dtype, clip=clip).dequantize(np.float32)
            input_scale, found = static_scale_search(x, weight, np.asarray(dequantized), static_absmax)
            record["input_scale"] = {"objective": "output error", "ratio_to_max": float(found.ratios[0]),
                                     "error_max": _rounded(found.error_plain),
                                     "error_searched": _rounded(found.error_searched)}
        else:
            record["input_scale"] = {"objective": "max (no activation rows)", "ratio_to_max": 1.0}
    return LinearSearch(clip, input_scale, record)


class ScaleSearches:
    """The conversion's scale searches: ratios handed in (w8a8's, on activations) or searched here.

    Quantized linears run on a worker thread; each writes only its own key.
    """

    def __init__(self, enabled: bool, clip: dict[str, np.ndarray], records: dict[str, dict]):
        self.enabled = enabled
        self.clip = clip
        self.records = records

    def clip_for(self, module: str, weight: np.ndarray, scheme, flags) -> np.ndarray:
        """The clipping ratios of one linear's weight: handed in (the w8a8 stage's, searched on
        activations), else searched on the weight's error by `scheme` (a qconvert.schemes.Scheme)."""
        if module in self.clip:
            return self.clip[module]
        found = scheme.clip_search(weight, flags)
        self.records[module] = {**self.records.get(module, {}), "weight_clip": {
            "objective": "weight error", "error_plain": _rounded(found.error_plain),
            "error_searched": _rounded(found.error_searched), "mean_ratio": _rounded(float(np.mean(found.ratios)))}}
        return found.ratios

    def record(self, scheme) -> dict | None:
        """qconvert.json's `scale_search`: the method, its grids, and each linear's error before and after."""
        if not self.enabled:
            return None
        record = {"weight_clip": {"what": scheme.clip.what, "grid": list(scheme.clip.grid),
                                  "objective": "squared output error on calibration activations where the "
                                               "conversion has them (w8a8), else squared weight error"},
                  "modules": {m: self.records[m] for m in sorted(self.records)}}
        if any("input_scale" in r for r in self.records.values()):
            record["input_scale"] = {"what": "static input_scale = r * max|x| / 127",
                                     "grid": list(STATIC_RATIO_GRID),
                                     "objective": "squared output error of the quantized layer"}
        return record
