"""The scale search method: each linear's int8 weight clip on calibration rows, and static activation scales;
as a step of the calibration loop (`ScaleSearch`), and for the writer (`ScaleSearches`, the weight-only clips).

The int8 and NF4 weight clip searches themselves are their schemes' (schemes/int8.py, schemes/nf4.py). Each
search tries a fixed grid of candidates in one batched computation and
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
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.calibration.observer import LayerStats
from qconvert.calibration.statistics import KeptRows, Statistic
from qconvert.cluster.share import spread
from qconvert.formats.qarray import INT8_QMAX
from qconvert.formats.quotient import int8_round
from qconvert.methods.loop import Results, Step, weight_elements
from qconvert.methods.fold import apply_fold
from qconvert.methods.smooth import smoothed_input_absmax
from qconvert.schemes.base import SearchResult
from qconvert.schemes.int8 import int8_clip_search, quantize_int8

SCALE_SEARCH = "scale search"  # the step's progress stage
# The smallest static input_scale written (float32); the weight scales have the same floor.
MIN_INPUT_SCALE = 1e-8
# Candidate static input-scale ratios, largest (plain max) first.
STATIC_RATIO_GRID = tuple(round(2.0 ** (-k / 4), 4) for k in range(17))       # 1.00 .. 0.0625
_HI = jax.lax.Precision.HIGHEST


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


class ScaleSearch(Step):
    """The step: each linear's int8 weight clip, and with static activations its input scale, searched on its
    input rows once its weight is final (smoothed); the clips go to the steps after it (GPTQ keeps their scales)."""

    stage, unit = SCALE_SEARCH, "linears"

    def __init__(self, linears: Sequence[str], static: bool):
        self.linears, self.static = list(linears), static
        self._unsearched = list(linears)

    def statistics(self) -> list[Statistic]:
        return [KeptRows(frozenset(self.linears))]

    def stage_total(self) -> int:
        return len(self.linears)

    def layer(self, stats: LayerStats, results: Results) -> None:
        ready = [m for m in self._unsearched if m in results.act_absmax and m not in results.unsmoothed]
        if not ready:
            return
        self._unsearched = [m for m in self._unsearched if m not in ready]
        found = self._search(ready, results, stats.of(KeptRows))
        results.searches.update(found)
        results.clips.update({m: f.clip for m, f in found.items() if f.clip is not None})
        self.advance(min(len(results.searches), len(self.linears)))

    def _search(self, modules: list[str], results: Results, samples: Mapping[str, np.ndarray]
                ) -> dict[str, LinearSearch]:
        """The searches of `modules`, on their weights and inputs as smoothed."""
        folds = results.folds()
        col_scales = {m: g.input_scales for g in results.smoothing.values() for m in g.group.linears}

        def search(m: str, device) -> LinearSearch:
            del device  # the default device while it runs
            raw = results.params[f"{m}.weight"]
            fold = folds.get(f"{m}.weight")
            weight = np.asarray(raw, np.float32) if fold is None else apply_fold(np.asarray(raw, np.float32), fold)
            x = samples.get(m)
            s = col_scales.get(m)
            if x is not None and s is not None:
                x = x / s[None, :]
            static_absmax = smoothed_input_absmax(results.act_absmax[m], s) if self.static else None
            return search_linear(weight, x, scale_dtype=np.dtype(np.asarray(raw).dtype), clip_weights=True,
                                 static_absmax=static_absmax)

        # Spread over the devices (every process's in a run of several), the largest weights first.
        return spread(modules, [float(weight_elements(results.params, m)) for m in modules], search,
                      _encoded_search, _decoded_search)


def _encoded_search(found: LinearSearch) -> tuple[dict, dict]:
    return ({} if found.clip is None else {"clip": found.clip}), {"input_scale": found.input_scale,
                                                                   "record": found.record}


def _decoded_search(module: str, arrays: dict, meta: dict) -> LinearSearch:
    del module
    return LinearSearch(arrays.get("clip"), meta["input_scale"], meta["record"])


class StaticInputScales(Step):
    """The step (w8a8 with --act static): each quantized linear's per-tensor input scale, the searched one
    (ScaleSearch, before it) or max|x / s| / 127 of the calibrated maxima, once every step before it is done;
    with a `scheme` that stores its own calibrated scales (Scheme.calibrated_inputs), that scheme's from the
    same maxima (Scheme.input_scales)."""

    def __init__(self, modules: Sequence[str], scheme=None):
        self.modules, self.scheme = list(modules), scheme

    def finish(self, results: Results) -> None:
        if self.scheme is None:
            results.input_scales = static_input_scales(results, self.modules)
        else:
            smoothed = {m: g.input_scales for g in results.smoothing.values() for m in g.group.linears}
            absmax = {m: smoothed_input_absmax(results.act_absmax[m], smoothed.get(m)) for m in self.modules}
            dtypes = {m: np.dtype(results.params.checkpoint.dtype(f"{m}.weight"))
                      if hasattr(results.params, "checkpoint") else np.asarray(results.params[f"{m}.weight"]).dtype
                      for m in self.modules}
            results.input_scales = self.scheme.input_scales(absmax, dtypes)


def static_input_scales(results: Results, modules: Sequence[str]) -> dict[str, float]:
    """Each module's static input_scale: the searched one, else max|x / s| / 127 of the calibrated maxima."""
    searches = results.searches
    smoothed = {m: g.input_scales for g in results.smoothing.values() for m in g.group.linears}
    return {m: max(searches[m].input_scale, MIN_INPUT_SCALE)
            if m in searches and searches[m].input_scale is not None
            else static_input_scale(smoothed_input_absmax(results.act_absmax[m], smoothed.get(m)))
            for m in modules}


def static_input_scale(act_absmax: float) -> float:
    """The per-tensor input_scale max|x| / 127, clamped away from zero as the weight scales are (an input that
    was all zeros in calibration must not make a loader divide by zero)."""
    return max(float(act_absmax) / INT8_QMAX, MIN_INPUT_SCALE)
