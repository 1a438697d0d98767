"""The calibration stage of the quantize pipeline: the steps a run takes, chosen here, run by the per-layer loop,
and what they hand the writer (`Adjustments`).

`prepare_adjustments` takes the pipeline's already-opened source model (qconvert.source) and its options,
calibrates (or loads statistics) and returns Adjustments, whose parts the conversion takes as they are:
`weight_transform(name, array)` hands out smoothed norms and linears, `input_scales` the static per-tensor
activation scales, `weight_clip` the clipping ratios searched on calibration rows, `quantized` GPTQ's QArrays,
and the records go into qconvert.json. No more than one layer's rows are held at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from qconvert.calibration.data import BUILTIN, load_calibration, located_record
from qconvert.calibration.observer import check_calibration_fits
from qconvert.formats.act_stats import ActStats, check_stats_cover, load_act_stats
from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.record import SmoothingRecord
from qconvert.formats.safetensors_io import sha256_file
from qconvert.methods.awq import AWQ, check_awq_runs
from qconvert.methods.gptq import GPTQ, QuantizedStore, SequentialGPTQ
from qconvert.cluster.share import agree_settings, same_windows
from qconvert.methods.loop import Calibration, ModelTransform, Results, Step, run_layers, transform_model
from qconvert.methods.kv_cache import KVCacheScales
from qconvert.methods.scale_search import LinearSearch, ScaleSearch, StaticInputScales
from qconvert.methods.fold import TensorFold, apply_fold
from qconvert.methods.smoothquant import SmoothQuant
from qconvert.options import CalibrationOptions, ConvertOptions
from qconvert.progress import Reporter, as_reporter
from qconvert.source.resolve import SourceModel


@dataclasses.dataclass(frozen=True)
class Adjustments:
    """What the calibration stage hands the conversion: smoothing folds, static input scales, clips, GPTQ's
    QArrays, and the records."""

    folds: dict[str, TensorFold] = dataclasses.field(default_factory=dict)
    input_scales: dict[str, float] | None = None
    calibration_record: dict[str, Any] | None = None
    smoothing_record: SmoothingRecord | None = None
    weight_clip: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    search_records: dict[str, dict] = dataclasses.field(default_factory=dict)
    # GPTQ's QArrays by module (read back from the scratch folder), which the writer takes as they are.
    quantized: QuantizedStore | None = None
    rounding_record: dict[str, Any] | None = None
    # Tensors calibration adds to the folder beside the converted ones (the KV cache's scales), the
    # quantization_config keys that say what they are, and the records of the steps that made them.
    extra_tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    records: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A step's transform of the whole model (loop.Step.model_transform), applied before the folds; None: none.
    model_transform: ModelTransform | None = None

    def weight_transform(self, name: str, array: np.ndarray) -> np.ndarray:
        """The tensor as the converter should quantize or copy it: the whole model's transform, then smoothed
        where a group touches it."""
        if self.model_transform is not None:
            array = self.model_transform(name, np.asarray(array))
        fold = self.folds.get(name)
        return array if fold is None else apply_fold(array, fold, name)

    @property
    def transform(self) -> Callable[[str, np.ndarray], np.ndarray] | None:
        """`weight_transform`, or None when nothing is smoothed or transformed (linears then stream row block by
        row block)."""
        return self.weight_transform if self.folds or self.model_transform is not None else None


def runs_awq(source: SourceModel, options: ConvertOptions) -> bool:
    """Whether AWQ runs on `source`: --awq, or the scheme's default (ConvertOptions.uses_awq). A model with no
    forward pass (--any-architecture's weight-only decoders) refuses an explicit --awq (exit 2) and gives way to
    round-to-nearest by default, as GPTQ's default does."""
    if not options.uses_awq:
        return False
    if source.weight_only is not None:
        if options.awq:
            check_awq_runs(True)
        return False
    return True


def choose_steps(source: SourceModel, options: ConvertOptions, quantized_modules: Sequence[str],
                 gptq: SequentialGPTQ | None, flags: LayoutFlags | None = None) -> list[Step]:
    """The run's methods, in the order they see each layer: a method is one line here. Calibration runs when
    and only when some step is chosen (the pipeline asks here, once)."""
    scheme, calib, static = options.scheme_object, options.calibration, options.static_act
    linears = source.family.linear_names(source.params)
    # w8a8's activations are calibrated where they are smoothed or get static scales.
    activations = scheme.calibrates and (calib.smooth or static)
    steps: list[Step] = []
    if activations and calib.smooth:
        steps.append(SmoothQuant(source.model, source.family, calib, static))
    if runs_awq(source, options):  # before GPTQ, which then rounds the scaled weights
        steps.append(AWQ(source.model, source.family, scheme, flags or LayoutFlags(), quantized_modules))
    if activations and options.searches_scales and calib.act_stats is None:
        steps.append(ScaleSearch(linears, static))
    if (activations and static) or scheme.calibrated_inputs:  # the head's lm_head too, where included
        steps.append(StaticInputScales([*linears, *head_linears_for_static(source, linears, quantized_modules)],
                                       scheme if scheme.calibrated_inputs else None))
    if gptq is not None:
        steps.append(GPTQ(gptq, quantized_modules, source.model.num_layers))
    if options.kv_cache is not None:
        steps.append(KVCacheScales(source.model if source.weight_only is None else None, options.kv_cache))
    return steps


def prepare_adjustments(source: SourceModel, options: ConvertOptions, steps: Sequence[Step] | None = None,
                        progress: Reporter | Callable[[str], None] | None = None,
                        gptq: SequentialGPTQ | None = None, *, quantized_modules: Sequence[str] = (),
                        flags: LayoutFlags | None = None) -> Adjustments:
    """Calibrate (or load statistics) and run `steps` on `source` (None: choose_steps' for `quantized_modules`,
    `gptq` and the layout `flags`); `gptq` is the GPTQ step's rounding, whose codes and record the writer takes.

    `source` is the pipeline's opened model: calibration reads the very weights
    that are then written. No steps: no statistics, no adjustments.
    """
    if steps is None:
        steps = choose_steps(source, options, quantized_modules, gptq, flags)
    if not steps:
        return Adjustments()
    calib = options.calibration or CalibrationOptions()  # the defaults where the flags asked for none
    params = source.params
    linears = source.family.linear_names(params)
    progress = as_reporter(progress)
    results = Results(params)
    model_transform = transform_model(steps, results)  # before calibration: every later reader sees it
    if calib.act_stats is not None:
        stats = _loaded_stats(calib.act_stats, params, _covered_linears(steps, linears))
        results.act_absmax.update(stats.act_absmax)
    else:
        check_calibration_fits(source.model, params, source.config, calib.calib_samples, calib.calib_seqlen,
                               hessians=gptq is not None, sequential=gptq is not None,
                               shard_experts=calib.shard_experts)  # before any window
        data = load_calibration(calib.calib or BUILTIN, source.folder, source.config,
                                samples=calib.calib_samples, seqlen=calib.calib_seqlen, dataset=calib.dataset)
        # Several processes: the same windows everywhere (a copy of the text may sit at another path).
        agree_settings(same_windows(data.record()), "calibration")
        progress(f"calibrating on {data.samples} x {data.seqlen} tokens ({data.description})")
        run_layers(source.model, Calibration(data.input_ids, calib.batch_size, calib.shard_experts), steps,
                   results, progress)
        stats = ActStats(results.act_absmax, data.tokens, data.record(results.experts_split_over))
    for step in steps:
        step.finish(results)
    return dataclasses.replace(_adjustments(results, stats, gptq), model_transform=model_transform)


def _covered_linears(steps: Sequence[Step], linears: Sequence[str]) -> list[str]:
    """The linears a statistics file must cover: the blocks', and the head's where it gets a static scale."""
    static = [step for step in steps if isinstance(step, StaticInputScales)]
    return list(static[0].modules) if static else list(linears)


def _adjustments(results: Results, stats: ActStats, gptq: SequentialGPTQ | None) -> Adjustments:
    """What the finished steps hand the writer."""
    clips, records = _search_results(results.searches, gptq)
    return Adjustments(results.folds(), results.input_scales, stats.calibration, results.smoothing_record,
                       weight_clip=clips, search_records=records,
                       quantized=gptq.store if gptq is not None else None,
                       rounding_record=gptq.record() if gptq is not None else None,
                       extra_tensors=dict(results.extra_tensors), extra_config=dict(results.extra_config),
                       records=dict(results.records))


def _search_results(searches: Mapping[str, LinearSearch], gptq: SequentialGPTQ | None
                    ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The clip ratios and search records found on calibration rows, with the weight-only searches GPTQ ran
    (int8, nf4 with --scale-search)."""
    clips = {m: f.clip for m, f in searches.items() if f.clip is not None}
    records = {m: f.record for m, f in searches.items()}
    if gptq is not None:
        clips, records = {**gptq.searches.clip, **clips}, {**gptq.searches.records, **records}
    return clips, records


def head_linears_for_static(source: SourceModel, linears: Sequence[str], quantized_modules: Sequence[str]
                            ) -> list[str]:
    """The quantized modules outside the family's block `linears` that get a static input scale (the head's
    lm_head); UsageError, before anything is calibrated, for any other, which would get none."""
    extra = sorted(set(quantized_modules) - set(linears))
    head = {name[: -len(".weight")] for name in source.model.head_tensor_names()
            if name.endswith(".weight")}
    for module in extra:
        if module not in head:
            raise UsageError(f"--act static writes input scales only for the block linears and lm_head; "
                             f"{module} (from --include) is neither: leave it out of --include, or use "
                             "--act dynamic")
    return extra


def _loaded_stats(path, params, modules: Sequence[str]) -> ActStats:
    """--act-stats: the saved statistics, checked to cover every module at its input width; their calibration
    record names the file and its sha256."""
    stats = load_act_stats(path)
    check_stats_cover(stats, {m: int(params.checkpoint.shape(f"{m}.weight")[1]) for m in modules}, str(path))
    # The calibration file where the statistics file records it, from here (qconvert.json records it from OUT).
    record = {**located_record(stats.calibration or {}, path),
              "stats_file": {"name": Path(path).name, "sha256": sha256_file(path)}}
    return dataclasses.replace(stats, calibration=record)
