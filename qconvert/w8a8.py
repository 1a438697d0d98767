"""The W8A8 (SmoothQuant) preparation: calibrate, choose alpha, compute smoothing folds and static input scales.

`plan_w8a8` turns a model folder and the w8a8 flags into a W8A8Plan whose parts
the conversion pipeline takes as they are: `weight_transform(name, array)`
hands out smoothed norms and linears, `input_scales` the static per-tensor
activation scales, `weight_clip` the int8 clipping ratios searched on
calibration rows, and the records go into qconvert.json.

Calibration runs layer by layer; as soon as a layer's statistics are complete,
its groups get their smoothing (the alpha grid searched by default) and its
linears their searches, on the rows sampled from that layer's inputs, so no
more than one layer's rows are held at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from qconvert.calib_data import BUILTIN, DEFAULT_SAMPLES, DEFAULT_SEQLEN, load_calibration
from qconvert.calibrate import (DEFAULT_BATCH_SIZE, ActStats, check_stats_cover, iter_layer_stats,
                                load_act_stats, open_params)
from qconvert.errors import UsageError
from qconvert.formats.safetensors_io import sha256_file
from qconvert.models import build
from qconvert.models.registry import Architecture, SmoothingGroup, architecture_for
from qconvert.scale_search import LinearSearch, search_linear
from qconvert.smooth import (INT8_QMAX, MIN_SCALE, AlphaSpec, GroupScales, TensorFold, apply_fold,
                             fold_plan, group_scales, parse_alpha, read_group_weights, search_alpha,
                             smoothed_input_absmax, unmatched_alpha_keys)

ACT_MODES = ("dynamic", "static")
# The smallest static input_scale written (float32); the weight scales have the same floor.
MIN_INPUT_SCALE = 1e-8


@dataclasses.dataclass(frozen=True)
class W8A8Options:
    """The w8a8 flags of `qconvert quantize`."""

    calib: str | None = None          # None: the built-in corpus
    calib_samples: int = DEFAULT_SAMPLES
    calib_seqlen: int = DEFAULT_SEQLEN
    alpha: str | None = None          # None: the family's default
    smooth: bool = True
    act: str = "dynamic"
    act_stats: Path | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    scale_search: bool = True         # int8 weight clipping ratios (and static input scales) searched


@dataclasses.dataclass(frozen=True)
class W8A8Plan:
    """What the converter needs for w8a8: smoothing folds, static input scales, and the records."""

    folds: dict[str, TensorFold]
    input_scales: dict[str, float] | None
    calibration_record: dict[str, Any] | None
    smoothing_record: dict[str, Any] | None
    weight_clip: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    search_records: dict[str, dict] = dataclasses.field(default_factory=dict)

    def weight_transform(self, name: str, array: np.ndarray) -> np.ndarray:
        """The tensor as the converter should quantize or copy it (smoothed where a group touches it)."""
        fold = self.folds.get(name)
        return array if fold is None else apply_fold(array, fold)


def check_options(options: W8A8Options) -> AlphaSpec:
    """Reject flag combinations that do not fit; the parsed --alpha."""
    if options.act not in ACT_MODES:
        raise UsageError(f"--act {options.act!r} is not one of {', '.join(ACT_MODES)}")
    spec = parse_alpha(options.alpha)
    if not options.smooth and options.alpha is not None:
        raise UsageError("--alpha has no effect with --no-smooth; drop one of them")
    if options.act_stats is not None and options.calib is not None:
        raise UsageError("--act-stats replaces calibration; drop --calib (or --act-stats)")
    if options.act_stats is not None and spec.auto and options.alpha is not None:
        raise UsageError("--alpha auto searches on calibration activations, which a statistics file "
                         "does not hold; drop --act-stats or give a fixed --alpha")
    if options.act_stats is not None and spec.auto:
        return AlphaSpec()  # the default search needs activation rows: the family's alpha instead
    return spec


def smoothing_groups(arch: Architecture, config: dict[str, Any]) -> list[SmoothingGroup]:
    """The family's norm -> linears groups, then its linear -> linear groups (the o/down remedy)."""
    return list(arch.smoothing_groups(config)) + list(arch.linear_smoothing_groups(config))


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


def _calibrate(folder: Path, config: dict[str, Any], params: Mapping, arch: Architecture,
               groups: list[SmoothingGroup], linears: list[str], spec: AlphaSpec, options: W8A8Options,
               progress: Callable[[str], None]) -> tuple[ActStats, dict[str, GroupScales], dict, dict]:
    """Run calibration; as each layer completes, choose its groups' smoothing and search its linears.

    Returns the statistics, every group's scales, the alpha search errors and
    the per-linear searches (clip ratios, static input scales).
    """
    data = load_calibration(options.calib or BUILTIN, folder, config,
                            samples=options.calib_samples, seqlen=options.calib_seqlen)
    progress(f"calibrating on {data.samples} x {data.seqlen} tokens ({data.description})")
    model = build(config)
    static = options.act == "static"
    keep = set(linears) if options.scale_search else set()
    keep |= {g.linears[0] for g in groups} if spec.auto else set()
    act_absmax: dict[str, np.ndarray] = {}
    chosen: dict[str, GroupScales] = {}
    errors: dict[str, dict[float, float]] = {}
    searches: dict[str, LinearSearch] = {}
    pending, unsearched = list(groups), list(linears)
    for layer in iter_layer_stats(model, params, data.input_ids, batch_size=options.batch_size,
                                  keep_inputs=keep):
        act_absmax.update(layer.act_absmax)
        for group in [g for g in pending if all(m in act_absmax for m in g.linears)]:
            pending.remove(group)
            weights = read_group_weights(params, group)
            absmax = group_act_absmax(act_absmax, group)
            if spec.auto:
                chosen[group.source], errors[group.source] = search_alpha(
                    group, absmax, weights, layer.input_samples[group.linears[0]], static=static)
            else:
                chosen[group.source] = group_scales(group, absmax, weights,
                                                  spec.alpha_for(group.source, arch.default_alpha))
        ready = [m for m in unsearched if m in act_absmax
                 and not any(m in g.linears or m == g.source for g in pending)]
        if options.scale_search and ready:
            searches.update(_search_linears(params, ready, chosen, act_absmax, layer.input_samples, options))
        unsearched = [m for m in unsearched if m not in ready]
        if layer.index < model.num_layers:  # the last LayerStats holds the head's inputs
            progress(f"layer {layer.index + 1}/{model.num_layers} calibrated")
    return ActStats(act_absmax, data.tokens, data.record()), chosen, errors, searches


def _search_linears(params: Mapping, modules: list[str], chosen: Mapping[str, GroupScales],
                    act_absmax: Mapping[str, np.ndarray], samples: Mapping[str, np.ndarray],
                    options: W8A8Options) -> dict[str, LinearSearch]:
    """The weight clip and static scale searches of `modules`, on their weights and inputs as smoothed."""
    folds = fold_plan([g for g in chosen.values()
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
                                 clip_weights=options.scale_search, static_absmax=static_absmax)
    return found


def plan_w8a8(folder: Path, config: dict[str, Any], options: W8A8Options,
              progress: Callable[[str], None] | None = None) -> W8A8Plan:
    """Calibrate (or load statistics), smooth, and derive static scales for a w8a8 conversion."""
    spec = check_options(options)
    progress = progress or (lambda message: None)
    if not options.smooth and options.act == "dynamic":
        return W8A8Plan({}, None, None, None)  # plain per-token W8A8 needs no statistics
    arch = architecture_for(config)
    params = open_params(folder, config)  # config vs weights before any calibration time is spent
    linears = arch.linear_names(params)
    groups = smoothing_groups(arch, config) if options.smooth else []
    unknown = unmatched_alpha_keys(spec, [g.source for g in groups])
    if unknown:
        raise UsageError(f"--alpha names {', '.join(unknown)}, which matches no smoothing group of "
                         f"this model; groups are e.g. {groups[0].source if groups else '(none)'}")
    searched: dict[str, GroupScales] = {}
    errors: dict[str, dict[float, float]] = {}
    searches: dict[str, LinearSearch] = {}
    if options.act_stats is not None:
        stats = load_act_stats(options.act_stats)
        check_stats_cover(stats, {m: int(params.checkpoint.shape(f"{m}.weight")[1]) for m in linears},
                          str(options.act_stats))
        calibration_record = dict(stats.calibration or {})
        calibration_record["stats_file"] = {"name": Path(options.act_stats).name,
                                            "sha256": sha256_file(options.act_stats)}
    else:
        stats, searched, errors, searches = _calibrate(folder, config, params, arch, groups, linears, spec,
                                                       options, progress)
        calibration_record = stats.calibration
    scales = []
    for group in groups:
        if group.source in searched:
            scales.append(searched[group.source])
            continue
        alpha = spec.alpha_for(group.source, arch.default_alpha)
        scales.append(group_scales(group, group_act_absmax(stats.act_absmax, group),
                                   read_group_weights(params, group), alpha))
    input_scales = None
    if options.act == "static":
        smoothed = {m: g.input_scales for g in scales for m in g.group.linears}
        input_scales = {m: max(searches[m].input_scale, MIN_INPUT_SCALE)
                        if m in searches and searches[m].input_scale is not None
                        else static_input_scale(smoothed_input_absmax(stats.act_absmax[m], smoothed.get(m)))
                        for m in linears}
    return W8A8Plan(fold_plan(scales), input_scales, calibration_record,
                    _smoothing_record(scales, spec, arch, errors, options) if options.smooth else None,
                    weight_clip={m: f.clip for m, f in searches.items() if f.clip is not None},
                    search_records={m: f.record for m, f in searches.items()})


def static_input_scale(act_absmax: float) -> float:
    """The per-tensor input_scale max|x| / 127, clamped away from zero as the weight scales are (an input that
    was all zeros in calibration must not make a loader divide by zero)."""
    return max(float(act_absmax) / INT8_QMAX, MIN_INPUT_SCALE)


def _smoothing_record(scales: list[GroupScales], spec: AlphaSpec, arch: Architecture,
                      errors: dict[str, dict[float, float]], options: W8A8Options) -> dict[str, Any]:
    mode = "auto" if spec.auto else ("family default" if spec.default is None and not spec.per_group
                                     else "given")
    if mode == "family default" and options.alpha is None:
        mode = "family default (a statistics file holds no activation rows to search on)"
    record: dict[str, Any] = {
        "method": "smoothquant",
        "alpha_mode": mode,
        "family_default_alpha": arch.default_alpha,
        "min_scale": MIN_SCALE,
        "remedy": arch.remedy,
        "alpha": {g.group.source: g.alpha for g in scales},
        "groups": {g.group.source: list(g.group.linears) for g in scales},
    }
    if errors:
        # The relative W8A8 output error of each alpha tried, per group, rounded for reading.
        record["alpha_search"] = {source: {f"{a:.2f}": float(f"{e:.4g}") for a, e in tried.items()}
                                  for source, tried in errors.items()}
    return record


def quantize_w8a8(model: str, out: Path, options, w8a8: W8A8Options, *, progress=None,
                  message: Callable[[str], None] | None = None):
    """`qconvert quantize --scheme w8a8`: calibrate and smooth, then convert with the plan's hooks.

    A dry run skips calibration unless static scales are asked for (the plan
    needs one per linear).
    """
    from qconvert.convert import check_output_target, convert
    from qconvert.hub import resolve_model
    from qconvert.models.weight_only import check_architecture
    from qconvert.output import check_output_location
    from qconvert.stages import stage

    if options.scheme != "w8a8":
        raise UsageError("calibration and smoothing flags apply to --scheme w8a8 only")
    if options.act != w8a8.act:
        raise UsageError(f"--act {w8a8.act} and the conversion's act {options.act} disagree")
    check_options(w8a8)
    started = time.perf_counter()
    # --scale-search/--no-scale-search (ConvertOptions) wins; unset, the w8a8 options decide.
    if options.scale_search is None:
        options = dataclasses.replace(options, scale_search=w8a8.scale_search)
    w8a8 = dataclasses.replace(w8a8, scale_search=options.searches_scales)
    if not options.dry_run:
        check_output_target(model, Path(out), options.overwrite)  # before the calibration's time is spent
    if options.dry_run and w8a8.act == "dynamic":
        plan = W8A8Plan({}, None, None, None)
    else:
        with stage("resolving the model"):
            resolved = resolve_model(model, options.revision, check_architecture=functools.partial(
                check_architecture, any_architecture=options.any_architecture, scheme=options.scheme))
        if not options.dry_run:
            check_output_location(Path(out), resolved.folder)
        with stage("calibration"):
            plan = plan_w8a8(resolved.folder, resolved.config, w8a8, progress=message)
    calibrated = time.perf_counter() - started
    result = convert(model, out, options, weight_transform=plan.weight_transform if plan.folds else None,
                     input_scales=plan.input_scales, calibration_record=plan.calibration_record,
                     smoothing_record=plan.smoothing_record, weight_clip=plan.weight_clip,
                     search_records=plan.search_records, progress=progress)
    phases = ((("calibrated", calibrated),) if plan.calibration_record is not None else ()) + result.phases
    return dataclasses.replace(result, seconds=time.perf_counter() - started, phases=phases)
