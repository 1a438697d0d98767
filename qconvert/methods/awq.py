"""AWQ (activation-aware weight quantization) as a step: per smoothing group, the per-channel scale s whose scaled,
quantized weights give the group's linears the least output error on calibration rows, folded as SmoothQuant's is.

For a group (a norm or a linear feeding some linears), input channel j gets
s_j from two statistics: act_mean_j = mean |x_j| over every calibration token,
and w_mean_j, the mean over the group's quantized linears' rows of
|w_ij| / max|w| of the quantization group (or block, or row) holding w_ij. The
candidates are llm-compressor's AWQModifier(duo_scaling="both"), on a grid of
alphas 0, 0.05, ..., 0.95: act_mean^a alone, and act_mean^a / (w_mean^(1-a) +
1e-4), each clamped at >= 1e-4 and normalised by sqrt(max s * min s). A
candidate's error is the mean squared difference, on the calibration rows the
loop keeps, between the float linears' outputs X W^T and (X / s) Q(W * s)^T,
Q being the scheme's own quantize and dequantize, so int4, nf4, int8 and any
other scheme are searched alike; the
first least error wins (alpha 0 alone is s = 1, so AWQ never does worse than
plain rounding on those rows). The chosen s folds into the source exactly as
SmoothQuant's scales (smooth.TensorFold, Gemma's stored gain included), so the
float model's function is unchanged, and GPTQ then rounds the scaled weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.calibration.observer import LayerStats
from qconvert.calibration.statistics import InputAbsMean, KeptRows, Statistic
from qconvert.formats.errors import UsageError
from qconvert.formats.qarray import QArray
from qconvert.formats.record import SmoothingRecord
from qconvert.methods.group_scales import GroupScaleStep, recorded_scales, smoothing_groups, written_scales
from qconvert.methods.loop import Results, weight_elements
from qconvert.methods.fold import GroupScales, channel_map
from qconvert.models.family import Family, FamilyFacts, SmoothingGroup

AWQ_SEARCH = "AWQ search"  # the step's progress stage
AWQ_ALPHAS = tuple(round(0.05 * k, 2) for k in range(20))  # 0 .. 0.95
MIN_AWQ_SCALE = 1e-4    # llm-compressor's clamp of s, and the epsilon beside w_mean^(1-a)
WEIGHT_NORM_EPS = 1e-6  # beside each quantization group's max|w| in w_mean (llm-compressor's)
_HI = jax.lax.Precision.HIGHEST

# A float weight [out, in] and its dtype -> the float32 weight the scheme's quantization of it stands for.
QuantizeDequantize = Callable[[np.ndarray, np.dtype], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: alpha, and whether w_mean divides (duo scaling) or act_mean stands alone."""

    alpha: float
    duo: bool

    @property
    def key(self) -> str:
        """How qconvert.json names it: '0.35' for act^a / w^(1-a), '0.35 act-only' for act^a."""
        return f"{self.alpha:.2f}" if self.duo else f"{self.alpha:.2f} act-only"


# llm-compressor's order for "both": each alpha without duo scaling, then with it (the first least error wins).
CANDIDATES = tuple(Candidate(a, duo) for a in AWQ_ALPHAS for duo in (False, True))


def weight_mean(weights: Sequence[np.ndarray], chunks: Sequence[int]) -> np.ndarray:
    """Per input column, the mean over every row of the given [out, in] weights of |w| / (max|w| + 1e-6), the max
    taken over the `chunk` consecutive elements (in row-major order) quantized together (float32 [in], computed in
    float64)."""
    total, rows = np.zeros(np.shape(weights[0])[1], np.float64), 0
    for w, chunk in zip(weights, chunks):
        w = np.abs(np.asarray(w, np.float64))
        flat = w.reshape(-1)
        padded = np.pad(flat, (0, -len(flat) % chunk))  # a last partial block (NF4's) counts as its own
        blocks = padded.reshape(-1, chunk)
        normalised = (blocks / (blocks.max(axis=1, keepdims=True) + WEIGHT_NORM_EPS)).reshape(-1)[:len(flat)]
        total += normalised.reshape(w.shape).sum(axis=0)
        rows += w.shape[0]
    return (total / max(rows, 1)).astype(np.float32)


def candidate_scales(act_mean: np.ndarray, w_mean: np.ndarray, candidate: Candidate) -> np.ndarray:
    """s of one candidate: act^a [/ (w^(1-a) + 1e-4)], clamped at 1e-4, over sqrt(max s * min s); computed in
    float64 and rounded once to the float32 the fold and the record use.

    The rounding matters beyond its size: a quantization group's absmax lands on a tie (+-7.5 steps for int4),
    which the last bit of the scaled weight decides, so s is made the same way everywhere.
    """
    alpha = float(candidate.alpha)
    s = np.power(np.asarray(act_mean, np.float64), alpha)
    if candidate.duo:
        s = s / (np.power(np.asarray(w_mean, np.float64), 1.0 - alpha) + MIN_AWQ_SCALE)
    s = np.maximum(s, MIN_AWQ_SCALE)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = s / np.sqrt(s.max() * s.min())
    return np.where(np.isfinite(s), s, 1.0).astype(np.float32)


def quantization_chunk(shape: tuple[int, int], block_size: int | None, scale_size: int) -> int:
    """How many consecutive elements of a [out, in] weight one scale covers, from the scheme's QArray: its block
    size, else a row (one scale per output channel), else the whole tensor."""
    if block_size:
        return int(block_size)
    return int(shape[1]) if scale_size == shape[0] else int(np.prod(shape))


@jax.jit
def _reference_outputs(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w.T, precision=_HI)


@jax.jit
def _squared_error(x: jax.Array, y: jax.Array, s: jax.Array, w_q: jax.Array) -> jax.Array:
    """sum ((X / s) W_q^T - Y)^2: the output error of the scaled, quantized weight."""
    return jnp.sum((jnp.matmul(x / s[None, :], w_q.T, precision=_HI) - y) ** 2)


@jax.jit
def _dequantized(q: QArray) -> jax.Array:
    """QArray.dequantize in float32 as one program per shape (eagerly, its few ops cost more than the search's
    matmuls on small linears)."""
    return q.dequantize(jnp.float32)


@dataclasses.dataclass(frozen=True)
class GroupInputs:
    """What one group's search reads: its quantized linears' float32 weights and dtypes, each one's input rows,
    and act_mean, the mean |x| per input channel over every calibration token (float32 [in])."""

    weights: dict[str, np.ndarray]
    dtypes: dict[str, np.dtype]
    rows: dict[str, np.ndarray]
    act_mean: np.ndarray


def search_group(group: SmoothingGroup, inputs: GroupInputs, quantize: QuantizeDequantize,
                 chunks: Mapping[str, int]) -> tuple[GroupScales, dict[str, float]]:
    """The candidate whose scales give the group's quantized linears the least mean squared output error, as
    GroupScales (alpha the candidate's), and every candidate's error by its key."""
    index = channel_map(group, len(inputs.act_mean))
    act = _per_source(inputs.act_mean, index)
    w_mean = _per_source(weight_mean(list(inputs.weights.values()), [chunks[m] for m in inputs.weights]), index)
    read = np.zeros(len(act), bool)
    read[index] = True
    refs = {}
    for m, w in inputs.weights.items():
        if len(inputs.rows[m]):
            x = jnp.asarray(_padded_rows(inputs.rows[m]))
            refs[m] = (x, _reference_outputs(x, jnp.asarray(w)))
    elements = sum(len(inputs.rows[m]) * w.shape[0] for m, w in inputs.weights.items() if m in refs)
    errors: dict[str, float] = {}
    best, best_error = None, np.inf
    for candidate in CANDIDATES:
        s_read = candidate_scales(act[read], w_mean[read], candidate)
        s_source = np.ones(len(act), np.float32)
        s_source[read] = s_read  # a source channel no input reads (a strided source's gap) keeps 1
        s_in = s_source[index]
        total = 0.0
        for m, (x, y) in refs.items():
            # The weight as the writer folds it (float32 product, back to its dtype), then the scheme's rounding.
            scaled = (inputs.weights[m] * s_in[None, :]).astype(inputs.dtypes[m])
            w_q = jnp.asarray(quantize(scaled, inputs.dtypes[m]), jnp.float32)
            total += float(_squared_error(x, y, jnp.asarray(s_in), w_q))
        error = total / max(elements, 1)
        errors[candidate.key] = error
        if error < best_error:  # strictly less: the first least error wins, as llm-compressor's
            best, best_error = (candidate, s_source, s_in), error
    if best is None:
        raise UsageError(f"AWQ found no finite output error for the group of {group.source}: the float model "
                         "overflows there; fix the checkpoint or convert without --awq")
    candidate, s_source, s_in = best
    return GroupScales(group, candidate.alpha, s_source, s_in), errors


def _padded_rows(x: np.ndarray) -> np.ndarray:
    """Rows [n, in] with zero rows up to a power of two: experts see differing token counts, and zero rows add
    no error, so a few row counts compile a few programs instead of one per expert."""
    n = len(x)
    size = 1 << max(4, (n - 1).bit_length())
    return np.pad(np.asarray(x, np.float32), ((0, size - n), (0, 0)))


def _per_source(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The mean of `values` over the consumer channels that read each source channel (0 where none reads it):
    query heads sharing a KV head share its scale."""
    sums = np.zeros(int(index.max()) + 1, np.float64)
    counts = np.zeros_like(sums)
    np.add.at(sums, index, np.asarray(values, np.float64))
    np.add.at(counts, index, 1)
    return (sums / np.maximum(counts, 1)).astype(np.float32)


class AWQ(GroupScaleStep):
    """The step: each smoothing group with a quantized linear searched once its layer's rows are complete."""

    stage = AWQ_SEARCH

    def __init__(self, model: Family, family: FamilyFacts, scheme, flags, quantized_modules: Sequence[str]):
        quantized = set(quantized_modules)
        super().__init__([g for g in smoothing_groups(model) if any(m in quantized for m in g.linears)])
        self.family, self.scheme, self.flags, self.quantized = family, scheme, flags, quantized

    def statistics(self) -> list[Statistic]:
        linears = frozenset(m for g in self.groups for m in g.linears)
        return [KeptRows(linears), InputAbsMean(linears)]

    def ready(self, group: SmoothingGroup, stats: LayerStats, results: Results) -> bool:
        return all(m in stats.of(KeptRows) for m in group.linears)

    def cost(self, group: SmoothingGroup, results: Results) -> float:
        return float(sum(weight_elements(results.params, m) for m in group.linears if m in self.quantized))

    def choose(self, group: SmoothingGroup, results: Results, stats: LayerStats
               ) -> tuple[GroupScales | None, dict[str, float] | None]:
        """One group searched on its layer's rows (None where no calibration row reached its linears); groups
        calibration never reached keep s = 1 (unfolded)."""
        samples = stats.of(KeptRows)
        quantized = [m for m in group.linears if m in self.quantized]
        act_mean = _group_act_mean(group, stats.of(InputAbsMean))
        if act_mean is None or not any(len(samples[m]) for m in quantized):
            return None, None
        raw = {m: np.asarray(results.params[f"{m}.weight"]) for m in quantized}
        inputs = GroupInputs({m: w.astype(np.float32) for m, w in raw.items()},
                             {m: w.dtype for m, w in raw.items()},
                             {m: np.asarray(samples[m], np.float32) for m in quantized}, act_mean)
        chunks = {m: self._chunk(w) for m, w in raw.items()}
        scales, errors = search_group(group, inputs, self._quantize_dequantize, chunks)
        return written_scales(scales, results.params), errors

    def _quantize_dequantize(self, weight: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """The scheme's own rounding of `weight`, back in float32."""
        return np.asarray(_dequantized(self.scheme.quantize(weight, self.flags, scale_dtype=dtype)))

    def _chunk(self, weight: np.ndarray) -> int:
        """The elements one of the scheme's scales covers in this weight (read from its own QArray)."""
        q = self.scheme.quantize(weight, self.flags, scale_dtype=weight.dtype)
        return quantization_chunk(weight.shape, q.block_size, int(np.size(q.scale)))

    def record(self, results: Results) -> SmoothingRecord:
        """qconvert.json's `smoothing`, method "awq": each group's chosen alpha, every candidate's output error,
        and the exact scales folded (verify checks them as SmoothQuant's)."""
        searched = {source: {k: float(f"{e:.4g}") for k, e in tried.items()} for source, tried in self.errors.items()}
        return SmoothingRecord(
            alpha_mode=("awq: per group, the candidate s = act_mean^alpha / (w_mean^(1-alpha) + 1e-4) (key 'ALPHA') "
                        "or act_mean^alpha (key 'ALPHA act-only'), normalised by sqrt(max s * min s), with the least "
                        "mean squared output error of its quantized linears on calibration rows"),
            family_default_alpha=None, min_scale=MIN_AWQ_SCALE, remedy=self.family.remedy,
            **recorded_scales(results),
            alpha_search=searched or None, method="awq")


def _group_act_mean(group: SmoothingGroup, abs_means: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """act_mean of the group's input, from a linear of the group that reads every token (not an expert, which
    sees only the tokens routed to it: the router or the shared expert), else the first any token reached."""
    everyone = [m for m in group.linears if ".experts." not in m and m in abs_means]
    reached = [m for m in group.linears if m in abs_means]
    chosen = (everyone or reached or [None])[0]
    return None if chosen is None else np.asarray(abs_means[chosen], np.float32)


def check_awq_runs(weight_only: bool) -> None:
    """UsageError (exit 2) for --awq on a model with no forward to calibrate (--any-architecture's weight-only
    decoders); the flags it does not fit are refused by ConvertOptions."""
    if weight_only:
        raise UsageError("--awq needs the model's forward pass for calibration, which --any-architecture does not "
                         "have for this model; drop --awq")
