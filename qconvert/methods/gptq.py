"""GPTQ as a step: each layer's linears rounded on their Hessians, spilled to disk, the layer run again on them.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.cluster.share import spread
from qconvert.calibration.observer import LayerStats
from qconvert.calibration.statistics import InputHessian, Statistic
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.qarray import QArray
from qconvert.formats.errors import OutputWriteError, UsageError
from qconvert.methods.gptq_core import DEFAULT_DAMP, GPTQConfig, hessian_factor, round_columns, row_output_errors
from qconvert.methods.gptq_rows import round_rows, split_groups
from qconvert.methods.scale_search import ScaleSearches
from qconvert.methods.loop import Results, Step, weight_shape
from qconvert.methods.fold import TensorFold, apply_fold

GPTQ_ROUNDING = "GPTQ"  # the step's progress stage


class QuantizedStore:
    """QArrays written to a scratch folder as raw bytes, one file per leaf; read back on demand (a Mapping)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._meta: dict[str, tuple[int, dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]] = {}

    def put(self, module: str, q: QArray) -> None:
        index = len(self._meta)
        leaves = {}
        for leaf in ("qvalue", "scale", "zero_point"):
            if getattr(q, leaf) is None:  # a symmetric scheme's zero point
                continue
            array = np.ascontiguousarray(np.asarray(getattr(q, leaf)))
            try:
                (self.folder / f"{index}.{leaf}").write_bytes(array.tobytes())
            except OSError as err:
                raise OutputWriteError(
                    f"writing GPTQ's scratch in {self.folder.parent} failed: {err.strerror or err}; GPTQ keeps one "
                    "byte a quantized weight there until the output is written (about twice an int4 output): "
                    "free space or choose another -o") from None
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


class DiscardedStore:
    """The store of a process that writes nothing (one of several, not process 0): it keeps no codes."""

    def put(self, module: str, q: QArray) -> None:
        del module, q

    def __contains__(self, module: object) -> bool:
        return False

    def get(self, module: str) -> QArray | None:
        return None


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
        """Round `modules` (of layer stats.index) with GPTQ; their dequantized weights wait for `replacement`.

        Linears that read one input (q/k/v, gate/up) share one Hessian factorization and are rounded as one
        matrix of their stacked rows (GPTQ treats every row alike), so each layer runs the same few programs.
        The groups are spread over the devices (every process's, in a run of several): each is solved on the
        device `owners` gives it, and what the processes solved is shared, so every process holds every
        group's result (the same bytes whichever device solved it).
        """
        effective = {}
        groups = {group[0]: group for group in _sharing_groups([m for m in modules if m in stats.of(InputHessian)], stats,
                                                               folds)}
        costs = {key: _cost(group, self.params) for key, group in groups.items()}
        rows = [sum(weight_shape(self.params, m)[0] for m in group) for group in groups.values()]
        split = dict(zip(groups, split_groups(list(costs.values()), rows, len(jax.devices()))))
        whole = [key for key in groups if not split[key]]
        solved = spread(whole, [costs[key] for key in whole],
                        lambda key, device: self._round(stats, groups[key], folds, device),
                        self._encoded, self._decoded)
        for key in groups:  # the groups a device would hold the layer up with: every device rounds their rows
            if split[key]:
                solved[key] = self._round(stats, groups[key], folds, jax.local_devices()[0], rows_split=True)
        for key, group in groups.items():
            for m in group:
                q, values, dtype = solved[key][m]
                self.store.put(m, q)
                effective[f"{m}.weight"] = _unfolded(values, folds.get(f"{m}.weight")).astype(dtype)
        self._pending[stats.index] = effective

    def _round(self, stats: LayerStats, group: list[str], folds: Mapping[str, TensorFold], device,
               rows_split: bool = False) -> dict[str, tuple[QArray, np.ndarray, np.dtype]]:
        """One sharing group rounded: per linear its QArray, its float32 values and the source's dtype. With
        `rows_split`, every device of every process rounds a block of its rows (gptq_rows), and every process
        holds the whole group's result."""
        tokens = stats.of(InputHessian)[group[0]]["tokens"]
        weights = {m: self._weight(m, folds.get(f"{m}.weight")) for m in group}
        shared = self.scheme.shared_absmax(sorted(weights), lambda m: _absmax(weights[m][0]))
        rtn = {m: self.scheme.quantize(w, self.flags, scale_dtype=raw_dtype, clip=self._clip(m, w),
                                       **({"shared_absmax": shared[m]} if m in shared else {}))
               for m, (w, raw_dtype) in weights.items()}
        h = jax.device_put(stats.of(InputHessian)[group[0]]["hessian"], device)
        if tokens == 0 or not float(jnp.max(jnp.diagonal(h))) > 0:
            # An expert no calibration token reached, or an input that was all zeros: nothing to round on.
            chosen = rtn
            values = {m: np.asarray(q.dequantize(np.float32)) for m, q in rtn.items()}
            self.errors.update({m: {"tokens": tokens, "method": "rtn"} for m in group})
        else:
            fold = folds.get(f"{group[0]}.weight")
            if fold is not None and fold.col_multiplier is not None:
                h = _smoothed_hessian(h, fold.col_multiplier)
            chosen, values = self._round_group(group, {m: w for m, (w, _) in weights.items()}, rtn, h, tokens,
                                               rows_split)
        return {m: (chosen[m], np.asarray(values[m]), np.dtype(weights[m][1])) for m in group}

    def _encoded(self, solved: dict[str, tuple[QArray, np.ndarray, np.dtype]]) -> tuple[dict, dict]:
        """A group's results as arrays and JSON (for the other processes), its error records included."""
        arrays, meta = {}, {}
        for m, (q, values, dtype) in solved.items():
            arrays.update({f"{m}:qvalue": np.asarray(q.qvalue), f"{m}:scale": np.asarray(q.scale),
                           f"{m}:values": values})
            if q.zero_point is not None:
                arrays[f"{m}:zero_point"] = np.asarray(q.zero_point)
            meta[m] = {"kind": str(q.kind), "block_size": q.block_size, "shape": list(q.shape), "dtype": q.dtype,
                       "source_dtype": np.dtype(dtype).name, "errors": self.errors[m],
                       "search": self.searches.records.get(m)}  # a clip searched on the weight here
        return arrays, meta

    def _decoded(self, key: str, arrays: dict, meta: dict) -> dict[str, tuple[QArray, np.ndarray, np.dtype]]:
        del key
        solved = {}
        for m, info in meta.items():
            self.errors[m] = info["errors"]
            if info["search"] is not None:
                self.searches.records[m] = info["search"]
            q = QArray(qvalue=arrays[f"{m}:qvalue"], scale=arrays[f"{m}:scale"],
                       zero_point=arrays.get(f"{m}:zero_point"), kind=info["kind"],
                       block_size=info["block_size"], shape=tuple(info["shape"]), dtype=info["dtype"])
            solved[m] = (q, arrays[f"{m}:values"], jnp.dtype(info["source_dtype"]))
        return solved

    def replacement(self, index: int) -> dict[str, np.ndarray] | None:
        """Layer `index`'s weights as GPTQ rounded them (None when it rounded none)."""
        return self._pending.pop(index, None) or None

    def _weight(self, module: str, fold: TensorFold | None) -> tuple[np.ndarray, np.dtype]:
        raw = np.asarray(self.params[f"{module}.weight"])
        weight = raw if fold is None else apply_fold(raw, fold, f"{module}.weight")
        return weight, raw.dtype  # as the writer would quantize it

    def _clip(self, module: str, weight: np.ndarray):
        return self.searches.clip_for(module, weight, self.scheme, self.flags) if self.searches.enabled else None

    def _round_group(self, group: list[str], weights: dict[str, np.ndarray], rtn: dict[str, QArray], h,
                     tokens: int, rows_split: bool = False) -> tuple[dict[str, QArray], dict[str, np.ndarray]]:
        """GPTQ's QArrays of a group of linears sharing Hessian h, and the float32 weights they stand for."""
        factor = hessian_factor(h, self.config.damp, act_order=self.config.act_order)
        if not bool(jnp.isfinite(factor[0]).all()):
            raise self._singular(group[0], h.shape[0], tokens)
        stacked = np.concatenate([np.asarray(weights[m], np.float32) for m in group])
        steps = np.concatenate([self.scheme.gptq_steps(rtn[m], self.flags) for m in group])
        offsets = [self.scheme.gptq_offsets(rtn[m], self.flags) for m in group]  # zero points, asymmetric grids
        offsets = None if offsets[0] is None else np.concatenate(offsets)
        rtn_values = np.concatenate([np.asarray(rtn[m].dequantize(np.float32)) for m in group])
        grid, block_size = self.scheme.gptq_grid(), self.config.block_size
        if rows_split:
            codes, values = round_rows(stacked, steps, offsets, factor, grid=grid, block_size=block_size)
        else:
            codes, values = round_columns(jnp.asarray(stacked), jnp.asarray(steps), *factor, grid=grid,
                                          block_size=block_size,
                                          offsets=None if offsets is None else jnp.asarray(offsets))
        # On the whole group, where it was rounded by rows too: a product's float32 sums over a block of rows
        # need not be those over all of them (the records are one device's bytes).
        errors, reference = row_output_errors(stacked, jnp.stack([values, rtn_values]), h)
        if not bool(np.isfinite(np.asarray(values)).all()):  # checked where produced: NaN never reaches a code
            raise self._singular(group[0], h.shape[0], tokens)
        return self._chosen(group, weights, rtn, np.asarray(codes), np.asarray(values),
                            np.asarray(errors, np.float64), np.asarray(reference, np.float64), tokens)

    def _chosen(self, group: list[str], weights: dict[str, np.ndarray], rtn: dict[str, QArray], codes: np.ndarray,
                values: np.ndarray, errors: np.ndarray, reference: np.ndarray, tokens: int
                ) -> tuple[dict[str, QArray], dict[str, np.ndarray]]:
        """Per linear of a group, its QArray of GPTQ's codes and its rows of values; its output errors recorded."""
        chosen, dequantized, start = {}, {}, 0
        for m in group:
            rows = slice(start, start + weights[m].shape[0])
            start = rows.stop
            chosen[m] = self.scheme.gptq_qarray(rtn[m], codes[rows])
            dequantized[m] = values[rows]
            denominator = max(float(reference[rows].sum()), float(np.finfo(np.float32).tiny))
            self.errors[m] = {"tokens": tokens, "error_gptq": _rounded(float(errors[0, rows].sum()) / denominator),
                              "error_rtn": _rounded(float(errors[1, rows].sum()) / denominator)}
        return chosen, dequantized

    def _singular(self, module: str, width: int, tokens: int) -> UsageError:
        return UsageError(
            f"GPTQ cannot round {module}: its input Hessian, damped by --gptq-damp {self.config.damp:g}, is not "
            f"positive definite in float32 ({tokens:,} calibration tokens for an input {width:,} wide); raise "
            f"--gptq-damp (default {DEFAULT_DAMP:g}) or calibrate on more tokens (--calib-samples x --calib-seqlen)")

    def record(self) -> dict[str, Any]:
        """qconvert.json's `rounding`: GPTQ's settings and, per linear, its relative output error on the
        calibration inputs against round-to-nearest's (tr(D H D^T) / tr(W H W^T))."""
        return {**self.config.record(), "modules": {m: self.errors[m] for m in sorted(self.errors)}}


class GPTQ(Step):
    """The step: the quantized linears rounded by `SequentialGPTQ` as each layer's Hessians are complete, on their
    weights as the steps before it left them (smoothed, with the searched clips), the layer then run again."""

    rewrites = True
    stage = GPTQ_ROUNDING

    def __init__(self, gptq: SequentialGPTQ, modules: Sequence[str], layers: int):
        self.gptq, self.modules, self.layers = gptq, list(modules), layers
        self._unrounded = list(modules)

    def statistics(self) -> list[Statistic]:
        return [InputHessian(frozenset(self.modules))]

    def stage_total(self) -> int:
        return self.layers if self.modules else 0

    def layer(self, stats: LayerStats, results: Results) -> None:
        now = [m for m in self._unrounded if m in stats.of(InputHessian)]
        if not now:
            return
        self.gptq.params = results.params  # as a whole-model transform before calibration left them
        # GPTQ keeps the scales the clip search found for the linears it rounds now.
        self.gptq.searches.clip.update({m: results.clips[m] for m in now if m in results.clips})
        self.gptq.layer(stats, now, results.folds())
        self._unrounded = [m for m in self._unrounded if m not in now]
        self.advance(min(stats.index + 1, self.layers))

    def replacement(self, index: int) -> dict[str, np.ndarray] | None:
        return self.gptq.replacement(index)


def _sharing_groups(modules: list[str], stats: LayerStats, folds: Mapping[str, TensorFold]) -> list[list[str]]:
    """The modules grouped by the Hessian they are rounded on (the same input, smoothed alike), in order."""
    groups: dict[tuple, list[str]] = {}
    for m in modules:
        fold = folds.get(f"{m}.weight")
        multiplier = None if fold is None or fold.col_multiplier is None else fold.col_multiplier.tobytes()
        groups.setdefault((id(stats.of(InputHessian)[m]["hessian"]), multiplier), []).append(m)
    return list(groups.values())


def _cost(group: list[str], params: Mapping) -> float:
    """A sharing group's share of GPTQ's work: its rows times the input width squared (the column loop), plus
    the width cubed (the factorization)."""
    width = weight_shape(params, group[0])[-1]
    rows = sum(weight_shape(params, m)[0] for m in group)
    return float(rows * width * width + width ** 3)


def _absmax(weight: np.ndarray) -> float:
    """A weight's largest magnitude, as the writer reads it for a scale the scheme shares between linears."""
    return float(np.abs(np.asarray(weight, np.float32)).max(initial=0.0))


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

