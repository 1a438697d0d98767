"""The quantize pipeline: resolve MODEL once, plan, calibrate, stream-quantize into packed shards, write OUT atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from qconvert import __version__, cluster
from qconvert.write.card import CARD_NAME, CardFacts, write_card
from qconvert.formats.errors import FormatError, InvalidCheckpointError, InvalidWeightError, QConvertError, UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.quantized_sources import SourceFormat
from qconvert.formats.record import ConversionRecord, SourceRecord, write_record
from qconvert.formats.safetensors_io import SafetensorsCheckpoint, write_shards
from qconvert.models.weight_only import WeightOnlySelection
from qconvert.options import ConvertOptions, CalibrationOptions  # noqa: F401  (ConvertOptions' home; imported from here)
from qconvert.write.folder import (
    check_free_space, check_output_free, check_output_location, check_writable, copy_side_files, hash_in_background,
    scratch_folder, side_files, staged_output, write_json,
)
from qconvert.plan import FLOAT_WEIGHT_DTYPES, ConversionPlan, PlannedTensor, is_float_array, plan_conversion
from qconvert.write.prefetch import available_cores, run_ahead
from qconvert.write.upload import Upload
from qconvert.methods.scale_search import ScaleSearches
from qconvert.source.resolve import SourceModel, open_source, resolve_source
from qconvert.stages import stage
from qconvert.methods.gptq_core import DEFAULT_ACT_ORDER, DEFAULT_DAMP, GPTQConfig
from qconvert.methods.gptq import RTN_RECORD, DiscardedStore, QuantizedStore, SequentialGPTQ
from qconvert.methods.recipe import Adjustments, prepare_adjustments, runs_awq

# The exponent bits of each float weight dtype: all ones exactly for NaN and Inf.
EXPONENT_BITS = {"float32": (np.uint32, 0x7F800000), "float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80)}
class Progress(Protocol):
    """What the pipeline reports while it streams (the CLI draws a bar from it)."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What a conversion did (or, with dry_run, would do)."""

    out: Path | None
    source: dict[str, Any]
    scheme: str
    dry_run: bool
    tensors: tuple[PlannedTensor, ...]
    input_bytes: int
    output_bytes: int
    seconds: float
    files: dict[str, str]
    # Named phases and their seconds, in order (e.g. calibrated, wrote); `seconds` is the whole run.
    phases: tuple[tuple[str, float], ...] = ()
    weight_only: WeightOnlySelection | None = None  # set when --any-architecture chose the linears
    # Lines for the user once the folder is written, never before an error.
    notes: tuple[str, ...] = ()
    # One line when vLLM TPU is recorded refusing the folder's scheme: what it takes instead (shown with --verbose).
    server_note: str = ""
    # A dry run's: what a real run would refuse (raised by the CLI once the list is printed).
    refusal: QConvertError | None = None
    # Linears chosen by the architecture or --include that stay float for the loaders: routers, conv1d.
    kept_float: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    upload: Upload | None = None  # --upload-repo's commit (a dry run: where it would go)

    @property
    def compression_ratio(self) -> float:
        return self.input_bytes / self.output_bytes if self.output_bytes else 0.0

    @property
    def quantized_modules(self) -> list[str]:
        return [t.module for t in self.tensors if t.module is not None]

    def summary(self) -> dict[str, Any]:
        """The machine-readable summary `quantize --json` prints."""
        return {
            "out": str(self.out) if self.out else None, "source": self.source, "scheme": self.scheme,
            "dry_run": self.dry_run, "quantized_modules": len(self.quantized_modules),
            "unchanged_tensors": sum(t.module is None for t in self.tensors),
            "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
            "compression_ratio": round(self.compression_ratio, 4), "seconds": round(self.seconds, 3),
            "phases": {name: round(seconds, 3) for name, seconds in self.phases},
            "files": self.files,
            "weight_only": self.weight_only.record() if self.weight_only else None,
            "notes": list(self.notes), "server_note": self.server_note or None,
            "refusal": str(self.refusal) if self.refusal else None,
            "kept_float": {kind: list(modules) for kind, modules in self.kept_float.items()},
            "upload": self.upload.record() if self.upload else None,
            "tensors": [{"name": t.module or t.source, "kind": t.kind, "shape": list(t.shape),
                         "source_bytes": t.source_bytes, "output_bytes": t.output_bytes} for t in self.tensors],
        }


def convert(model: str, out, options: ConvertOptions, *, progress: Progress | None = None,
            message: Callable[[str], None] | None = None) -> ConvertResult:
    """`qconvert quantize`: MODEL (a folder or Hub id) into OUT, each step once.

    Check OUT; resolve MODEL (one commit for a Hub branch) and find its family;
    open its checkpoint (closed at the end); plan every output tensor; for adjustments, calibrate and
    smooth on that same checkpoint (qconvert.methods.recipe); stream-quantize into shards
    beside OUT; write config.json and qconvert.json; rename into place.
    `message` receives the adjustments stage's progress lines.
    """
    started = time.perf_counter()
    out = Path(out)
    writes = not options.dry_run and cluster.is_leader()  # of several processes, process 0 writes
    if writes:
        check_output_target(model, out, options.overwrite)  # before any download
    resolved = resolve_source(model, options.revision, scheme=options.scheme_object,
                              any_architecture=options.any_architecture)
    if writes and resolved.is_hub:
        check_output_location(out, resolved.folder)  # not inside the Hub cache either
    try:
        with stage("planning"):
            source = open_source(resolved, any_architecture=options.any_architecture)
        with source:
            plan, adjustments, files, phases = _convert_source(source, out, options, progress, message)
    except FormatError as err:
        raise InvalidCheckpointError(f"{err}") from None
    ckpt = source.checkpoint
    return ConvertResult(
        out=None if options.dry_run else out,
        source=source.summary(),
        scheme=options.scheme, dry_run=options.dry_run, tensors=plan.tensors,
        input_bytes=sum(ckpt.nbytes(name) for name in ckpt.tensor_names),
        output_bytes=sum(spec.nbytes for spec in plan.specs),
        seconds=time.perf_counter() - started, files=files, phases=tuple(phases),
        weight_only=source.weight_only,
        notes=tuple(n for n in (gptq_data_note(adjustments, ckpt),) if n), server_note=plan.server_note,
        refusal=plan.refusal, kept_float=plan.kept_float,
    )


def _convert_source(source: SourceModel, out: Path, options: ConvertOptions, progress: Progress | None,
                    message: Callable[[str], None] | None
                    ) -> tuple[ConversionPlan, Adjustments, dict[str, str], list[tuple[str, float]]]:
    """Plan, calibrate where the scheme or GPTQ needs it, and write OUT (not for a dry run): the plan, the adjustments
    stage's adjustments, the output files' hashes and the seconds of each phase."""
    scheme = options.scheme_object
    with stage("planning"):
        plan = plan_conversion(source, scheme=scheme, include=options.include, exclude=options.exclude,
                               double_quant=options.double_quant, static_act=options.static_act,
                               group_size=options.group_size, dry_run=options.dry_run)
    for note in plan.notes:
        if message is not None:
            message(note)
    phases: list[tuple[str, float]] = []
    files: dict[str, str] = {}
    if not options.dry_run and cluster.is_leader():
        _check_space(out, plan, options)
    with contextlib.ExitStack() as scratch:
        gptq = _sequential_gptq(source, plan, options, out, scratch)
        adjustments = Adjustments()
        if (scheme.calibrates or gptq or runs_awq(source, options)) and not (options.dry_run
                                                               and (not options.static_act or plan.refusal)):
            calibration_started = time.perf_counter()
            agree_run(source, options, plan)
            with stage("calibration"):
                adjustments = prepare_adjustments(source, options, message, plan.quantized_modules, gptq,
                                                  plan.flags)
            if adjustments.calibration_record is not None:
                phases.append(("calibrated", time.perf_counter() - calibration_started))
        if options.static_act and not plan.refusal:
            _check_input_scales(plan, adjustments.input_scales or {})
        if not options.dry_run and cluster.is_leader():
            writing_started = time.perf_counter()
            files = write_output(source, out, plan, options, adjustments, progress)
            phases.append(("wrote", time.perf_counter() - writing_started))
    return plan, adjustments, files, phases


def _check_space(out: Path, plan: ConversionPlan, options: ConvertOptions) -> None:
    """Before any work: OUT's disk holds the output and, with GPTQ, its scratch (one byte a quantized weight and
    the scales, kept until the output is written) at once (exit 9 when it cannot)."""
    output = sum(spec.nbytes for spec in plan.specs)
    scratch = 0
    if options.uses_gptq:
        scratch = sum(int(np.prod(t.shape)) + t.output_bytes // 8 for t in plan.tensors if t.module is not None)
    what = "the output" + (f" and GPTQ's scratch ({scratch / 2**30:,.2f} GiB while it runs)" if scratch else "")
    check_free_space(out.parent, output + scratch, what)


# GPTQ's Hessian needs many more calibration tokens than the linear's input width to stand for other text.
GPTQ_TOKENS_PER_INPUT = 10


def gptq_data_note(adjustments: Adjustments, ckpt) -> str | None:
    """A line for the user when GPTQ rounded on fewer calibration tokens than GPTQ_TOKENS_PER_INPUT times the
    widest input it rounded: its codes then fit the calibration text more than text in general."""
    rounding, calibration = adjustments.rounding_record, adjustments.calibration_record
    if not rounding or rounding.get("method") != "gptq" or not calibration:
        return None
    widths = [int(ckpt.shape(f"{m}.weight")[-1]) for m, e in rounding["modules"].items() if "error_gptq" in e]
    tokens, widest = int(calibration.get("tokens") or 0), max(widths, default=0)
    if not widest or tokens >= GPTQ_TOKENS_PER_INPUT * widest:
        return None
    return (f"GPTQ rounded on {tokens:,} calibration tokens, fewer than {GPTQ_TOKENS_PER_INPUT}x the widest "
            f"input it rounded ({widest:,}): its codes fit that text more than text in general; "
            f"--calib with {GPTQ_TOKENS_PER_INPUT * widest:,} tokens or more of text like the model's use "
            "generalizes better (--calib-samples x --calib-seqlen)")


def _sequential_gptq(source: SourceModel, plan: ConversionPlan, options: ConvertOptions, out: Path,
                     scratch: contextlib.ExitStack) -> SequentialGPTQ | None:
    """The run's GPTQ (its codes spilled to a scratch folder beside OUT), or None when it rounds to nearest.

    A decoder converted by --any-architecture has no forward to calibrate: GPTQ's
    default gives way to round-to-nearest there, an explicit --gptq is refused.
    """
    if not options.uses_gptq or options.dry_run:
        return None
    if source.weight_only is not None:
        if options.gptq:
            raise UsageError("--gptq needs the model's forward pass for calibration, which --any-architecture "
                             "does not have for this model; pass --no-gptq")
        return None
    # Of several processes, only process 0 keeps the codes (it writes them).
    store = QuantizedStore(scratch.enter_context(scratch_folder(out))) if cluster.is_leader() else DiscardedStore()
    config = GPTQConfig(damp=DEFAULT_DAMP if options.gptq_damp is None else float(options.gptq_damp),
                        act_order=DEFAULT_ACT_ORDER if options.gptq_act_order is None else bool(options.gptq_act_order))
    return SequentialGPTQ(source.params, options.scheme_object, plan.flags, config,
                          store, ScaleSearches(options.searches_scales, {}, {}))


def agree_source(source: SourceModel) -> None:
    """In a run of several processes, before calibrating: every process's copy of the source has process 0's
    sha256, file for file (exit 6 when one differs). Nothing for one process."""
    if cluster.active():
        folder = source.resolved.folder
        cluster.agree_source(hash_in_background(folder, input_files(folder, source.checkpoint))())


def agree_run(source: SourceModel, options: ConvertOptions, plan: ConversionPlan) -> None:
    """In a run of several processes, before calibrating: the same settings (exit 2 when a process was started
    with others: its collectives would not match) and the same source files (exit 6) on every process."""
    if not cluster.active():
        return
    calib = options.calibration
    cluster.agree_settings({
        "--scheme": options.scheme, "flags": options.recorded_flags(plan.flags), "--gptq": options.uses_gptq,
        "--gptq-damp": options.gptq_damp, "--gptq-act-order": options.gptq_act_order, "--awq": options.uses_awq,
        "--calib-samples": calib.calib_samples if calib else None, "--calib-seqlen": calib.calib_seqlen if calib else None,
        "--alpha": calib.alpha if calib else None, "--no-smooth": (not calib.smooth) if calib else None})
    agree_source(source)


def write_output(source: SourceModel, out: Path, plan: ConversionPlan, options: ConvertOptions,
                 adjustments: Adjustments, progress: Progress | None) -> dict[str, str]:
    """Write the planned tensors, config.json and qconvert.json beside OUT, then rename into place; the file hashes."""
    resolved, ckpt = source.resolved, source.checkpoint
    files: dict[str, str] = {}
    searches = ScaleSearches(options.searches_scales, dict(adjustments.weight_clip), dict(adjustments.search_records))
    source_hashes = hash_in_background(resolved.folder, input_files(resolved.folder, ckpt))
    with stage("writing the output"), staged_output(out, options.overwrite) as staging:
        stream = stream_tensors(ckpt, plan, options, adjustments.transform, adjustments.input_scales or {}, progress, searches,
                                adjustments.quantized)
        try:
            files.update(write_shards(staging, plan.specs, stream, options.max_shard_size))
        finally:
            stream.close()  # stops the worker at once if writing failed
        files.update(copy_side_files(resolved.folder, staging))
        files["config.json"] = write_json(staging / "config.json", quantized_config(resolved.config, plan, options))
        record = ConversionRecord(
            options.scheme, {}, source_record(resolved, out, source_hashes(), source.source_format),
            __version__, options.recorded_flags(plan.flags), adjustments.calibration_record, adjustments.smoothing_record,
            searches.record(options.scheme_object), adjustments.rounding_record or dict(RTN_RECORD),
            source.weight_only.record() if source.weight_only is not None else None)
        files[CARD_NAME] = write_card(staging, card_facts(source, plan, options, record))
        write_record(staging, dataclasses.replace(record, files=dict(sorted(files.items()))))
    return dict(sorted(files.items()))


def source_record(resolved, out: Path, hashes: dict[str, str],
                  source_format: SourceFormat | None = None) -> SourceRecord:
    """qconvert.json's `source`: a Hub id with its revision and commit; a local folder by its name and where it
    lies from OUT (relative: no local path is published, and verify finds it from any working folder); the
    quantized format it was read as float from, if any."""
    fmt = source_format.name if source_format is not None else None
    if resolved.is_hub:
        return SourceRecord(resolved.model_id, True, resolved.revision, resolved.commit, hashes, format=fmt)
    folder = Path(os.path.abspath(resolved.folder))
    return SourceRecord(folder.name, False, None, None, hashes,
                        Path(os.path.relpath(folder, os.path.abspath(out))).as_posix(), fmt)


def card_facts(source: SourceModel, plan: ConversionPlan, options: ConvertOptions,
               record: ConversionRecord) -> CardFacts:
    """What the model card says: the record (less its file hashes), the scheme, the family and the sizes."""
    scheme, ckpt = options.scheme_object, source.checkpoint
    return CardFacts(
        record=record, quant_method=scheme.layout.quant_method,
        scheme_summary=scheme.summary, loads_in=scheme.loads_in, vllm_loads=scheme.vllm_loads,
        causal_lm=source.family.causal_lm or source.weight_only is not None,
        architecture=", ".join(source.config.get("architectures") or ["a model"]),
        quantized_linears=len(plan.quantized_modules),
        unchanged_tensors=sum(t.module is None for t in plan.tensors),
        input_bytes=sum(ckpt.nbytes(name) for name in ckpt.tensor_names),
        output_bytes=sum(spec.nbytes for spec in plan.specs), pip_packages=scheme.layout.pip_packages,
        act_applies=bool(scheme.act_modes), repo=options.card_repo,
        transformers_quantization_config=scheme.layout.transformers_quantization_config)


def check_output_target(model: str, out: Path, overwrite: bool) -> None:
    """OUT may not destroy the input (a local MODEL) or the current folder, nor replace what qconvert did not write."""
    local = Path(model).expanduser()
    check_output_location(out, local if local.is_dir() else None)
    check_output_free(out, overwrite)
    check_writable(out.parent, f"the output {out}")


def _check_input_scales(plan: ConversionPlan, input_scales: Mapping[str, float]) -> None:
    missing = [m for m in plan.quantized_modules if m not in input_scales]
    if missing:
        raise UsageError(f"static activations need an input scale for every quantized linear; "
                         f"{len(missing)} have none (first: {missing[0]})")


def all_finite(array: np.ndarray, chunk_elements: int = 1 << 22) -> bool:
    """Whether a float array has no NaN/Inf, checked in chunks so no full-size mask is allocated.

    float32/16 and bf16 values are NaN or Inf exactly when their exponent bits are all
    ones, so those are checked on the bits in numpy, on the array itself: the same
    answer as isfinite, and no other library is handed the tensor (after a jitted
    check, a 788 MB embedding was seen to stay alive until the thread's next jitted
    call). Other dtypes (float64) go through numpy's isfinite.
    """
    flat = np.ascontiguousarray(array).reshape(-1)
    if np.dtype(flat.dtype).name not in EXPONENT_BITS:
        return all(np.isfinite(flat[i:i + chunk_elements]).all() for i in range(0, flat.size, chunk_elements))
    uint, ones = EXPONENT_BITS[np.dtype(flat.dtype).name]
    bits, ones = flat.view(uint), uint(ones)
    scratch = np.empty(min(bits.size, chunk_elements), uint)
    for i in range(0, bits.size, chunk_elements):
        part = scratch[:min(chunk_elements, bits.size - i)]
        np.bitwise_and(bits[i:i + chunk_elements], ones, out=part)
        if (part == ones).any():
            return False
    return True


def prefetch_limit(plan: ConversionPlan) -> int:
    """Bytes of source tensors that may be in flight (read or quantized ahead, or being written) at once.

    One largest tensor's worth: peak memory stays near the largest tensor, while
    the linears of a layer (each a fraction of it) overlap their reads and
    quantization with the writing of the ones before.
    """
    return max((t.source_bytes for t in plan.tensors), default=0)


def stream_tensors(ckpt: SafetensorsCheckpoint, plan: ConversionPlan, options: ConvertOptions,
                   weight_transform, input_scales: Mapping[str, float],
                   progress: Progress | None, searches: ScaleSearches | None = None,
                   quantized: QuantizedStore | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every output tensor in plan order.

    Reading, transforming, checking and quantizing run on `options.workers` threads
    (default: one per available core) ahead of the consumer (the shard writer), within
    `prefetch_limit` bytes; the results come in plan order whatever the thread count.
    """
    if progress is not None:
        progress.start(sum(t.source_bytes for t in plan.tensors), len(plan.tensors))
    tasks = ((planned.source_bytes, functools.partial(output_tensors, ckpt, planned, options, weight_transform,
                                                      input_scales, searches, plan.flags, quantized))
             for planned in plan.tensors)
    return run_ahead(tasks, prefetch_limit(plan), on_done=progress.advance if progress is not None else None,
                     workers=options.workers or available_cores())


def output_tensors(ckpt: SafetensorsCheckpoint, planned: PlannedTensor, options: ConvertOptions,
                   weight_transform, input_scales: Mapping[str, float],
                   searches: ScaleSearches | None = None, flags: LayoutFlags | None = None,
                   quantized: QuantizedStore | None = None) -> list[tuple[str, np.ndarray]]:
    """The (name, array) output tensors of one planned tensor: read, transform, check, quantize.

    A linear GPTQ rounded during calibration is taken from `quantized` as it is. An
    untransformed 2-D float linear whose scales are not searched is read a block of rows at a
    time (qconvert.schemes.rowwise), so its source is never held whole beside its codes.
    """
    if quantized is not None and planned.module in quantized:
        scheme = options.scheme_object
        tensors = scheme.layout.to_tensors(planned.module, quantized.get(planned.module),
                                           flags if flags is not None else scheme.layout_flags(),
                                           input_scale=input_scales.get(planned.module))
        return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]
    if (planned.module is not None and weight_transform is None and len(planned.shape) == 2
            and planned.source_dtype in FLOAT_WEIGHT_DTYPES and not (searches is not None and searches.enabled)):
        tensors = quantized_tensors(planned, functools.partial(ckpt.get_rows, planned.source), options,
                                    input_scales.get(planned.module), flags=flags)
        return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]
    array = ckpt.get(planned.source)
    if weight_transform is not None:
        array = _transformed(planned, weight_transform(planned.source, array))
    if planned.module is None:
        if is_float_array(array) and not all_finite(array):
            raise InvalidWeightError(f"{planned.source} has NaN or Inf values; fix the checkpoint")
        return [(planned.source, array)]
    tensors = quantized_tensors(planned, array, options, input_scales.get(planned.module), searches, flags)
    return [(spec.name, tensors.pop(spec.name)) for spec in planned.specs]


def _transformed(planned: PlannedTensor, array) -> np.ndarray:
    array = np.asarray(array)
    if tuple(array.shape) != planned.shape:
        raise ValueError(f"weight_transform changed the shape of {planned.source} to {list(array.shape)}")
    # The output keeps the source dtype whatever precision the transform computed in.
    return array.astype(np.dtype(planned.source_dtype), copy=False)


def quantized_tensors(planned: PlannedTensor, weight: np.ndarray | Callable[[int, int], np.ndarray],
                      options: ConvertOptions, input_scale: float | None,
                      searches: ScaleSearches | None = None, flags: LayoutFlags | None = None
                      ) -> dict[str, np.ndarray]:
    """One linear's weight -> its output tensors in the scheme's layout (NaN/Inf refused).

    `weight` is the array, or `read_rows(start, stop)` returning a block of its rows (no scale search).
    `flags` are the plan's layout flags (default: the options' own, for a scheme that needs no shapes).
    """
    scheme = options.scheme_object
    if flags is None:
        flags = scheme.layout_flags(act=options.act, double_quant=options.double_quant, group_size=options.group_size)
    dtype = np.dtype(planned.source_dtype)
    try:
        if callable(weight):
            q = scheme.quantize_rows(weight, planned.shape, dtype, flags)
        else:
            clip = None
            if searches is not None and searches.enabled:
                clip = searches.clip_for(planned.module, weight, scheme, flags)
            q = scheme.quantize(weight, flags, scale_dtype=dtype, clip=clip)
    except InvalidWeightError:
        raise InvalidWeightError(f"{planned.source} has NaN or Inf values; fix the checkpoint") from None
    return scheme.layout.to_tensors(planned.module, q, flags, input_scale=input_scale)


def quantized_config(config: dict[str, Any], plan: ConversionPlan, options: ConvertOptions) -> dict[str, Any]:
    """The source config.json with the scheme's quantization_config added."""
    declared = config.get("torch_dtype") or config.get("dtype")
    compute_dtype = declared if declared in FLOAT_WEIGHT_DTYPES else plan.float_dtype
    return {**config, "quantization_config": options.scheme_object.layout.quantization_config(
        plan.flags, tuple(plan.ignore), compute_dtype)}


def input_files(folder: Path, ckpt: SafetensorsCheckpoint) -> list[str]:
    """The files of the source folder a conversion reads (relative paths)."""
    inputs = [p.relative_to(folder).as_posix() for p in ckpt.files] + ["config.json"] + side_files(folder)
    if (folder / "model.safetensors.index.json").exists():
        inputs.append("model.safetensors.index.json")
    return inputs
