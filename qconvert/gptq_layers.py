"""Sequential GPTQ inside calibration: each layer's linears rounded on their Hessians, spilled to disk, run again.

As soon as a layer's statistics are complete, each of its quantized linears is
rounded: round-to-nearest first (the scheme's own quantizer, with the searched
clip where there is one) fixes the scales, then GPTQ chooses the codes on the
Hessian of the linear's input as the folder will see it (for w8a8, smoothed:
X / s, so H / (s s^T), and the smoothed weight W * s). The QArray goes to a
scratch folder at once, so a large model's codes never pile up in memory; the
writer reads it back instead of quantizing. The layer then runs again on the
dequantized weights (unsmoothed back, so the layer's other tensors stay as
they were), and the next layer is calibrated on those outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from qconvert.calibrate import LayerStats
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.qarray import QArray
from qconvert.gptq import GPTQConfig, gptq_codes, output_error
from qconvert.scale_search import ScaleSearches
from qconvert.smooth import TensorFold, apply_fold


class QuantizedStore:
    """QArrays written to a scratch folder as raw bytes, one file per leaf; read back on demand (a Mapping)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._meta: dict[str, tuple[int, dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]] = {}

    def put(self, module: str, q: QArray) -> None:
        index = len(self._meta)
        leaves = {}
        for leaf in ("qvalue", "scale"):
            array = np.ascontiguousarray(np.asarray(getattr(q, leaf)))
            (self.folder / f"{index}.{leaf}").write_bytes(array.tobytes())
            leaves[leaf] = (array.dtype.name, array.shape)
        meta = {"kind": str(q.kind), "block_size": q.block_size, "shape": q.shape, "dtype": q.dtype}
        self._meta[module] = (index, meta, leaves)

    def __contains__(self, module: object) -> bool:
        return module in self._meta

    def get(self, module: str) -> QArray | None:
        if module not in self._meta:
            return None
        index, meta, leaves = self._meta[module]
        arrays = {leaf: np.frombuffer((self.folder / f"{index}.{leaf}").read_bytes(), np.dtype(dtype)).reshape(shape)
                  for leaf, (dtype, shape) in leaves.items()}
        return QArray(**arrays, **meta)


@dataclasses.dataclass
class SequentialGPTQ:
    """GPTQ over a calibration run: `layer(...)` rounds a layer's linears, `replacement(i)` hands the runner
    layer i's quantized weights to run again on."""

    params: Mapping
    scheme: Any                 # qconvert.schemes.base.Scheme
    flags: LayoutFlags
    config: GPTQConfig
    store: QuantizedStore
    searches: ScaleSearches
    errors: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    _pending: dict[int, dict[str, np.ndarray]] = dataclasses.field(default_factory=dict)

    def layer(self, stats: LayerStats, modules: list[str], folds: Mapping[str, TensorFold]) -> None:
        """Round `modules` (of layer stats.index) with GPTQ; their dequantized weights wait for `replacement`."""
        effective = {}
        for module in modules:
            if module not in stats.hessians:
                continue
            fold = folds.get(f"{module}.weight")
            q, dequantized = self._round(module, stats.hessians[module], stats.hessian_tokens[module], fold)
            self.store.put(module, q)
            effective[f"{module}.weight"] = dequantized
        self._pending[stats.index] = effective

    def replacement(self, index: int) -> dict[str, np.ndarray] | None:
        """Layer `index`'s weights as GPTQ rounded them (None when it rounded none)."""
        return self._pending.pop(index, None) or None

    def _round(self, module: str, hessian, tokens: int, fold: TensorFold | None) -> tuple[QArray, np.ndarray]:
        raw = np.asarray(self.params[f"{module}.weight"])
        weight = raw if fold is None else apply_fold(raw, fold)  # as the writer would quantize it
        clip = self.searches.clip_for(module, weight, self.scheme, self.flags) if self.searches.enabled else None
        rtn = self.scheme.quantize(weight, self.flags, scale_dtype=raw.dtype, clip=clip)
        if tokens == 0:  # an expert no calibration token reached: no Hessian to round on
            self.errors[module] = {"tokens": 0}
            return rtn, _unfolded(np.asarray(rtn.dequantize(np.float32)), fold).astype(raw.dtype)
        h = hessian if fold is None or fold.col_multiplier is None else _smoothed_hessian(hessian, fold.col_multiplier)
        w = jnp.asarray(weight, jnp.float32)
        steps = self.scheme.gptq_steps(rtn, self.flags)
        codes = gptq_codes(w, h, jnp.asarray(steps), self.config.damp, grid=self.scheme.gptq_grid(),
                           block_size=self.config.block_size, act_order=self.config.act_order)
        q = self.scheme.gptq_qarray(rtn, np.asarray(codes))
        dequantized = np.asarray(q.dequantize(np.float32))
        self.errors[module] = {"tokens": tokens,
                               "error_gptq": _rounded(float(output_error(w, dequantized, h))),
                               "error_rtn": _rounded(float(output_error(w, rtn.dequantize(np.float32), h)))}
        return q, _unfolded(dequantized, fold).astype(raw.dtype)

    def record(self) -> dict[str, Any]:
        """qconvert.json's `rounding`: GPTQ's settings and, per linear, its relative output error on the
        calibration inputs against round-to-nearest's (tr(D H D^T) / tr(W H W^T))."""
        return {**self.config.record(), "modules": {m: self.errors[m] for m in sorted(self.errors)}}


def _smoothed_hessian(h, col_multiplier: np.ndarray):
    """The Hessian of the smoothed input X / s: H / (s s^T)."""
    inverse = jnp.asarray(1.0 / np.asarray(col_multiplier, np.float64), jnp.float32)
    return h * inverse[:, None] * inverse[None, :]


def _unfolded(weight: np.ndarray, fold: TensorFold | None) -> np.ndarray:
    """A smoothed linear's weight back in the source's terms (the inverse of apply_fold on a linear)."""
    if fold is None:
        return weight
    out = np.array(weight, np.float32)
    if fold.col_multiplier is not None:
        out = out / fold.col_multiplier[None, :]
    if fold.row_divisor is not None:
        rows = slice(fold.row_offset, fold.row_offset + len(fold.row_divisor))
        out[rows] = out[rows] * fold.row_divisor[:, None]
    return out


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


RTN_RECORD: dict[str, Any] = {"method": "rtn"}

