"""The w8a8 stage of the quantize pipeline: calibrate, choose alpha, compute smoothing folds and static input scales.

`prepare_w8a8` takes the pipeline's already-opened source model (qconvert.source.resolve)
and its options and returns W8A8Adjustments, whose parts the conversion takes as
they are: `weight_transform(name, array)` hands out smoothed norms and linears,
`input_scales` the static per-tensor activation scales, `weight_clip` the int8
clipping ratios searched on calibration rows, and the records go into qconvert.json.

Calibration runs layer by layer; as soon as a layer's statistics are complete,
its groups get their smoothing (the alpha grid searched by default) and its
linears their searches, on the rows sampled from that layer's inputs, so no
more than one layer's rows are held at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from qconvert.calibration.data import BUILTIN, load_calibration
from qconvert.calibration.observer import CALIBRATING, iter_layer_stats
from qconvert.formats.act_stats import ActStats, check_stats_cover, load_act_stats
from qconvert.formats.errors import UsageError
from qconvert.formats.record import RecordedScales, SmoothingRecord
from qconvert.formats.safetensors_io import sha256_file
from qconvert.methods.gptq import QuantizedStore, SequentialGPTQ
from qconvert.models.family import Family, FamilyFacts, SmoothingGroup
from qconvert.options import ConvertOptions, W8A8Options
from qconvert.progress import Reporter, as_reporter
from qconvert.methods.scale_search import LinearSearch, search_linear
from qconvert.methods.smooth import (INT8_QMAX, MIN_SCALE, AlphaSpec, GroupScales, TensorFold, apply_fold,
                             group_scales, read_group_weights, search_alpha, smoothed_input_absmax,
                             stored_gain_scales, tensor_folds, unmatched_alpha_keys)
from qconvert.source.resolve import SourceModel

# The smallest static input_scale written (float32); the weight scales have the same floor.
MIN_INPUT_SCALE = 1e-8
# The searches' progress stages (calibration's own is CALIBRATING).
ALPHA_SEARCH, SCALE_SEARCH, GPTQ_ROUNDING = "alpha search", "scale search", "GPTQ"


@dataclasses.dataclass(frozen=True)
class W8A8Adjustments:
    """What the w8a8 stage hands the conversion: smoothing folds, static input scales, clips, and the records."""

    folds: dict[str, TensorFold] = dataclasses.field(default_factory=dict)
    input_scales: dict[str, float] | None = None
    calibration_record: dict[str, Any] | None = None
    smoothing_record: SmoothingRecord | None = None
    weight_clip: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    search_records: dict[str, dict] = dataclasses.field(default_factory=dict)
    # GPTQ's QArrays by module (read back from the scratch folder), which the writer takes as they are.
    quantized: QuantizedStore | None = None
    rounding_record: dict[str, Any] | None = None

    def weight_transform(self, name: str, array: np.ndarray) -> np.ndarray:
        """The tensor as the converter should quantize or copy it (smoothed where a group touches it)."""
        fold = self.folds.get(name)
        return array if fold is None else apply_fold(array, fold)

    @property
    def transform(self) -> Callable[[str, np.ndarray], np.ndarray] | None:
        """`weight_transform`, or None when nothing is smoothed (linears then stream row block by row block)."""
        return self.weight_transform if self.folds else None


def smoothing_groups(model: Family) -> list[SmoothingGroup]:
    """The family's norm -> linears groups, then its linear -> linear groups (the o/down remedy)."""
    return model.smoothing_groups() + model.linear_smoothing_groups()


def group_act_absmax(act_absmax: Mapping[str, np.ndarray], group: SmoothingGroup) -> np.ndarray:
    """max|x| per channel of a group's input: element-wise max over its linears' statistics.

    The linears see the same input, except experts, which each see only the
    tokens routed to them; the max over all of them covers every token.
    """
    present = [act_absmax[m] for m in group.linears if m in act_absmax]
    if not present:
        raise UsageError(f"no activation statistics for {group.linears[0]}; calibrate this model again")
    return to_bfloat16(np.max(np.stack(present), axis=0))


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), as float32.

    The smoothing scales are shaped by these maxima. Calibration activations
    differ in their last bits between backends (GPU and CPU sum in different
    orders); maxima rounded to 8 significant bits agree unless one lies within
    that noise of a bfloat16 rounding boundary, so the smoothed weights do too.
    """
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _calibrate(source: SourceModel, groups: list[SmoothingGroup], linears: list[str], spec: AlphaSpec,
               options: ConvertOptions, progress: Reporter, gptq: SequentialGPTQ | None = None,
               rounded: Sequence[str] = ()) -> tuple[ActStats, dict[str, GroupScales], dict, dict]:
    """Run calibration; as each layer completes, choose its groups' smoothing, search its linears and, with
    `gptq`, round the `rounded` linears among them (the layer then runs again on them). Returns the statistics,
    every group's scales, the alpha search errors and the per-linear searches (clip ratios, static input
    scales); `progress` hears the layers calibrated, the groups and linears searched, the layers rounded."""
    calib, params, family, model = options.w8a8, source.params, source.family, source.model
    data = load_calibration(calib.calib or BUILTIN, source.folder, source.config,
                            samples=calib.calib_samples, seqlen=calib.calib_seqlen)
    progress(f"calibrating on {data.samples} x {data.seqlen} tokens ({data.description})")
    static = options.act == "static"
    searches_on_rows = options.searches_scales and options.scheme_object.calibrates
    # The rows kept: every linear's for the searches on rows, a group's first linear's for the alpha search.
    keep = (set(linears) if searches_on_rows else set()) | ({g.linears[0] for g in groups} if spec.auto else set())
    act_absmax: dict[str, np.ndarray] = {}
    chosen: dict[str, GroupScales] = {}
    errors: dict[str, dict[float, float]] = {}
    searches: dict[str, LinearSearch] = {}
    pending, unsearched, unrounded = list(groups), list(linears), list(rounded) if gptq is not None else []
    batching = {} if calib.batch_size is None else {"batch_size": calib.batch_size}
    steps = _CalibrationSteps(progress, model.num_layers, len(groups) if spec.auto else 0,
                              len(linears) if options.searches_scales else 0,
                              model.num_layers if gptq is not None and unrounded else 0)
    if gptq is not None:
        batching.update(hessians=frozenset(unrounded), replace=gptq.replacement)
    for layer in iter_layer_stats(model, params, data.input_ids, keep_inputs=keep, **batching):
        act_absmax.update(layer.act_absmax)
        for group in [g for g in pending if all(m in act_absmax for m in g.linears)]:
            pending.remove(group)
            chosen[group.source] = _group_smoothing(group, params, act_absmax, layer.input_samples, spec,
                                                    family.default_alpha, static, errors)
            if spec.auto:
                steps.alpha_searched(len(chosen))
        ready = [m for m in unsearched if m in act_absmax
                 and not any(m in g.linears or m == g.source for g in pending)]
        if searches_on_rows and ready:
            found = _search_linears(params, ready, chosen, act_absmax, layer.input_samples, options)
            searches.update(found)
            steps.scales_searched(len(searches))
            if gptq is not None:  # GPTQ keeps the scales these clips give
                gptq.searches.clip.update({m: f.clip for m, f in found.items() if f.clip is not None})
        unsearched = [m for m in unsearched if m not in ready]
        if layer.index < model.num_layers:  # the last LayerStats holds the head's inputs
            steps.calibrated(layer.index + 1)
        now = [m for m in unrounded if m in layer.hessians]
        if now:
            gptq.layer(layer, now, tensor_folds(list(chosen.values())))
            unrounded = [m for m in unrounded if m not in now]
            steps.rounded(min(layer.index + 1, model.num_layers))
    return ActStats(act_absmax, data.tokens, data.record()), chosen, errors, searches


def _group_smoothing(group: SmoothingGroup, params: Mapping, act_absmax: Mapping[str, np.ndarray],
                     samples: Mapping[str, np.ndarray], spec: AlphaSpec, family_alpha: float, static: bool,
                     errors: dict[str, dict[float, float]]) -> GroupScales:
    """A group's smoothing once its statistics are complete: alpha searched on its input rows (each alpha's
    error recorded in `errors`) or given; as the folder carries it (`written_scales`), which is what the clip
    search and GPTQ then round."""
    weights = read_group_weights(params, group)
    absmax = group_act_absmax(act_absmax, group)
    if spec.auto:
        scales, errors[group.source] = search_alpha(group, absmax, weights, samples[group.linears[0]],
                                                    static=static)
    else:
        scales = group_scales(group, absmax, weights, spec.alpha_for(group.source, family_alpha))
    return written_scales(scales, params)


class _CalibrationSteps:
    """The calibration stages' progress: layers calibrated; groups whose alpha and linears whose scales were
    searched; layers rounded by GPTQ (a stage with no work is not shown)."""

    def __init__(self, progress: Reporter, layers: int, groups: int, linears: int, rounding: int = 0):
        self._progress, self._layers, self._groups, self._linears = progress, layers, groups, linears
        progress.step(CALIBRATING, 0, layers)
        if groups:
            progress.step(ALPHA_SEARCH, 0, groups, "groups")
        if linears:
            progress.step(SCALE_SEARCH, 0, linears, "linears")
        if rounding:
            progress.step(GPTQ_ROUNDING, 0, layers)

    def calibrated(self, layers: int) -> None:
        self._progress.step(CALIBRATING, layers, self._layers)

    def alpha_searched(self, groups: int) -> None:
        self._progress.step(ALPHA_SEARCH, groups, self._groups, "groups")

    def rounded(self, layers: int) -> None:
        self._progress.step(GPTQ_ROUNDING, layers, self._layers)

    def scales_searched(self, linears: int) -> None:
        self._progress.step(SCALE_SEARCH, min(linears, self._linears), self._linears, "linears")


def _search_linears(params: Mapping, modules: list[str], chosen: Mapping[str, GroupScales],
                    act_absmax: Mapping[str, np.ndarray], samples: Mapping[str, np.ndarray],
                    options: ConvertOptions) -> dict[str, LinearSearch]:
    """The weight clip and static scale searches of `modules`, on their weights and inputs as smoothed."""
    folds = tensor_folds([g for g in chosen.values()
                          if any(m in g.group.linears or m == g.group.source for m in modules)])
    col_scales = {m: g.input_scales for g in chosen.values() for m in g.group.linears}
    found = {}
    for m in modules:
        raw = params[f"{m}.weight"]
        fold = folds.get(f"{m}.weight")
        weight = np.asarray(raw, np.float32) if fold is None else apply_fold(np.asarray(raw, np.float32), fold)
        x = samples.get(m)
        s = col_scales.get(m)
        if x is not None and s is not None:
            x = x / s[None, :]
        static_absmax = smoothed_input_absmax(act_absmax[m], s) if options.act == "static" else None
        # (only reached with --scale-search: without it a static input_scale is the plain max)
        found[m] = search_linear(weight, x, scale_dtype=np.dtype(np.asarray(raw).dtype),
                                 clip_weights=options.searches_scales, static_absmax=static_absmax)
    return found


def head_linears_for_static(source: SourceModel, quantized_modules: Sequence[str]) -> list[str]:
    """The quantized modules outside the family's block linears that get a static input scale (the head's
    lm_head); UsageError, before anything is calibrated, for any other, which would get none."""
    block = set(source.family.linear_names(source.params))
    extra = sorted(set(quantized_modules) - block)
    head = {name[: -len(".weight")] for name in source.model.head_tensor_names()
            if name.endswith(".weight")}
    for module in extra:
        if module not in head:
            raise UsageError(f"--act static writes input scales only for the block linears and lm_head; "
                             f"{module} (from --include) is neither: leave it out of --include, or use "
                             "--act dynamic")
    return extra


def prepare_w8a8(source: SourceModel, options: ConvertOptions,
                 progress: Reporter | Callable[[str], None] | None = None,
                 quantized_modules: Sequence[str] = (), gptq: SequentialGPTQ | None = None) -> W8A8Adjustments:
    """Calibrate (or load statistics), smooth, and derive static scales for a w8a8 conversion of `source`;
    with `gptq`, round the quantized modules by GPTQ during calibration (any scheme).

    `source` is the pipeline's opened model: calibration reads the very weights
    that are then written. Plain per-token W8A8 (no smoothing, dynamic) without
    GPTQ needs no statistics and gets no adjustments.
    """
    calib = options.w8a8
    smooths = options.scheme_object.calibrates and calib.smooth
    if gptq is None and (not options.scheme_object.calibrates or not (calib.smooth or options.act == "static")):
        return W8A8Adjustments()
    spec = calib.alpha_spec()
    progress = as_reporter(progress)
    family, params = source.family, source.params
    linears = family.linear_names(params)
    # Static scales for an included head (lm_head) too; any other included linear is refused here.
    head = head_linears_for_static(source, quantized_modules) if options.act == "static" else []
    groups = _checked_groups(source, spec) if smooths else []
    if calib.act_stats is not None:
        stats, searched, errors, searches = _loaded_stats(calib.act_stats, params, [*linears, *head]), {}, {}, {}
    else:
        stats, searched, errors, searches = _calibrate(source, groups, linears, spec, options, progress, gptq,
                                                       quantized_modules)
    scales = [searched[group.source] if group.source in searched else
              written_scales(group_scales(group, group_act_absmax(stats.act_absmax, group),
                                          read_group_weights(params, group),
                                          spec.alpha_for(group.source, family.default_alpha)), params)
              for group in groups]
    input_scales = (_static_input_scales(scales, searches, stats, [*linears, *head]) if options.act == "static"
                    else None)
    clips, records = _search_results(searches, gptq)
    return W8A8Adjustments(tensor_folds(scales), input_scales, stats.calibration,
                           _smoothing_record(scales, spec, family, errors, calib) if smooths else None,
                           weight_clip=clips, search_records=records,
                           quantized=gptq.store if gptq is not None else None,
                           rounding_record=gptq.record() if gptq is not None else None)


def _search_results(searches: Mapping[str, LinearSearch], gptq: SequentialGPTQ | None
                    ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The clip ratios and search records found on calibration rows, with the weight-only searches GPTQ ran
    (int8, nf4 with --scale-search)."""
    clips = {m: f.clip for m, f in searches.items() if f.clip is not None}
    records = {m: f.record for m, f in searches.items()}
    if gptq is not None:
        clips, records = {**gptq.searches.clip, **clips}, {**gptq.searches.records, **records}
    return clips, records


def _checked_groups(source: SourceModel, spec: AlphaSpec) -> list[SmoothingGroup]:
    """The model's smoothing groups; UsageError when --alpha names a group it does not have."""
    groups = smoothing_groups(source.model)
    unknown = unmatched_alpha_keys(spec, [g.source for g in groups])
    if unknown:
        raise UsageError(f"--alpha names {', '.join(unknown)}, which matches no smoothing group of "
                         f"this model; groups are e.g. {groups[0].source if groups else '(none)'}")
    return groups


def _loaded_stats(path, params, modules: Sequence[str]) -> ActStats:
    """--act-stats: the saved statistics, checked to cover every module at its input width; their calibration
    record names the file and its sha256."""
    stats = load_act_stats(path)
    check_stats_cover(stats, {m: int(params.checkpoint.shape(f"{m}.weight")[1]) for m in modules}, str(path))
    record = {**(stats.calibration or {}), "stats_file": {"name": Path(path).name, "sha256": sha256_file(path)}}
    return dataclasses.replace(stats, calibration=record)


def _static_input_scales(scales: Sequence[GroupScales], searches: Mapping[str, LinearSearch], stats: ActStats,
                         modules: Sequence[str]) -> dict[str, float]:
    """Each module's static input_scale: the searched one, else max|x / s| / 127 of the calibrated maxima."""
    smoothed = {m: g.input_scales for g in scales for m in g.group.linears}
    return {m: max(searches[m].input_scale, MIN_INPUT_SCALE)
            if m in searches and searches[m].input_scale is not None
            else static_input_scale(smoothed_input_absmax(stats.act_absmax[m], smoothed.get(m)))
            for m in modules}


def written_scales(scales: GroupScales, params: Mapping) -> GroupScales:
    """A group's scales as the folder carries them: a gain stored as an offset from 1 (Gemma) is rounded near
    -1, so its consumers fold what the stored gain really divides by (smooth.stored_gain_scales)."""
    if not scales.group.norm_offset:
        return scales
    return stored_gain_scales(scales, np.asarray(params[f"{scales.group.source}.weight"]))


def static_input_scale(act_absmax: float) -> float:
    """The per-tensor input_scale max|x| / 127, clamped away from zero as the weight scales are (an input that
    was all zeros in calibration must not make a loader divide by zero)."""
    return max(float(act_absmax) / INT8_QMAX, MIN_INPUT_SCALE)


def _smoothing_record(scales: list[GroupScales], spec: AlphaSpec, family: FamilyFacts,
                      errors: dict[str, dict[float, float]], options: W8A8Options) -> SmoothingRecord:
    """qconvert.json's `smoothing`: how alpha was chosen, each group's alpha, and the exact scales folded."""
    mode = "auto" if spec.auto else ("family default" if spec.default is None and not spec.per_group
                                     else "given")
    if mode == "family default" and options.alpha is None:
        mode = "family default (a statistics file holds no activation rows to search on)"
    # The relative W8A8 output error of each alpha tried, per group, rounded for reading.
    searched = {source: {f"{a:.2f}": float(f"{e:.4g}") for a, e in tried.items()} for source, tried in errors.items()}
    return SmoothingRecord(
        alpha_mode=mode, family_default_alpha=family.default_alpha, min_scale=MIN_SCALE, remedy=family.remedy,
        alpha={g.group.source: g.alpha for g in scales},
        groups={g.group.source: tuple(g.group.linears) for g in scales},
        scales={g.group.source: RecordedScales(g.source_scales, g.input_scales, g.group.source_offset,
                                               g.group.norm_offset) for g in scales},
        alpha_search=searched or None)
