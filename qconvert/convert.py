"""The quantize pipeline: resolve MODEL once, plan, calibrate, write OUT (qconvert.write) atomically."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qconvert import __version__, cluster
from qconvert.calibration.data import placed_record
from qconvert.formats.errors import FormatError, InvalidCheckpointError, QConvertError, UsageError
from qconvert.formats.record import ConversionRecord
from qconvert.models.weight_only import WeightOnlySelection
from qconvert.options import ConvertOptions, CalibrationOptions  # noqa: F401  (ConvertOptions' home; imported from here)
from qconvert.plan import ConversionPlan, PlannedTensor, plan_conversion
from qconvert.methods.scale_search import ScaleSearches
from qconvert.source.hub import ResolvedModel
from qconvert.source.resolve import SourceModel, open_source, resolve_source
from qconvert.stages import stage
from qconvert.methods.gptq_core import DEFAULT_ACT_ORDER, DEFAULT_DAMP, GPTQConfig
from qconvert.methods.gptq import RTN_RECORD, DiscardedStore, QuantizedStore, SequentialGPTQ
from qconvert.schemes.servers import family_of, kv_cache_note
from qconvert.methods.recipe import Adjustments, choose_steps, prepare_adjustments
from qconvert.write.folder import (
    check_free_space, check_output_free, check_output_location, check_writable, scratch_folder,
)
from qconvert.write.inputs import hash_in_background, input_files
from qconvert.write.output import write_output
from qconvert.write.tensors import Calibrated, Progress
from qconvert.write.upload import Upload


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

    Resolve MODEL (one commit for a Hub branch; OUT checked before any download) and
    open its checkpoint and family (closed at the end); plan every output tensor; calibrate
    where the scheme, AWQ or GPTQ needs it, on that same checkpoint (qconvert.methods.recipe);
    write the shards, config.json and qconvert.json beside OUT and rename into place
    (qconvert.write). `message` receives the planning notes and the calibration's progress lines.
    """
    started = time.perf_counter()
    out = Path(out)
    agree_run(options, out)  # before anything a process decides alone (a dry run, OUT, the source)
    resolved = _resolve(model, out, options)
    try:
        with stage("planning"):
            source = open_source(resolved, any_architecture=options.any_architecture)
        with source, contextlib.ExitStack() as scratch:
            plan = _plan(source, out, options, message)
            adjustments, phases = _calibrate(source, plan, options, out, scratch, message)
            files, wrote = _write(source, out, plan, options, adjustments, progress)
    except FormatError as err:
        raise InvalidCheckpointError(f"{err}") from None
    ckpt = source.checkpoint
    return ConvertResult(
        out=None if options.dry_run else out,
        source=source.summary(),
        scheme=options.scheme, dry_run=options.dry_run, tensors=plan.tensors,
        input_bytes=sum(ckpt.nbytes(name) for name in ckpt.tensor_names),
        output_bytes=sum(spec.nbytes for spec in plan.specs),
        seconds=time.perf_counter() - started, files=files, phases=tuple(phases + wrote),
        weight_only=source.weight_only,
        notes=tuple(n for n in (gptq_data_note(adjustments, ckpt),) if n), server_note=_server_note(source, plan, options),
        refusal=plan.refusal, kept_float=plan.kept_float,
    )


def _server_note(source: SourceModel, plan: ConversionPlan, options: ConvertOptions) -> str:
    """What vLLM TPU loads instead where it refuses the folder, or (with --kv-cache) where it would not read the
    scales by default."""
    kv_note = kv_cache_note(family_of(source.config)) if options.kv_cache is not None else ""
    return plan.server_note or kv_note


def _writes(options: ConvertOptions) -> bool:
    """Whether this process writes OUT: not for a dry run, and of several processes only process 0."""
    return not options.dry_run and cluster.is_leader()


def _resolve(model: str, out: Path, options: ConvertOptions) -> ResolvedModel:
    """MODEL resolved once (one commit for a Hub branch), its family found; OUT refused before any download when it
    would destroy the input, the current folder or what qconvert did not write, or lie inside the Hub cache."""
    if _writes(options):
        check_output_target(model, out, options.overwrite)  # before any download
    resolved = resolve_source(model, options.revision, scheme=options.scheme_object,
                              any_architecture=options.any_architecture)
    if _writes(options) and resolved.is_hub:
        check_output_location(out, resolved.folder)  # not inside the Hub cache either
    return resolved


def _plan(source: SourceModel, out: Path, options: ConvertOptions,
          message: Callable[[str], None] | None) -> ConversionPlan:
    """Every output tensor, its layout and the refusals, before a byte is read; the plan's notes told, and OUT's
    disk checked for room."""
    with stage("planning"):
        plan = plan_conversion(source, scheme=options.scheme_object, include=options.include,
                               exclude=options.exclude, double_quant=options.double_quant,
                               static_act=options.static_act, group_size=options.group_size,
                               dry_run=options.dry_run)
    for note in plan.notes:
        if message is not None:
            message(note)
    if _writes(options):
        _check_space(out, plan, options)
    return plan


def _calibrate(source: SourceModel, plan: ConversionPlan, options: ConvertOptions, out: Path,
               scratch: contextlib.ExitStack, message: Callable[[str], None] | None
               ) -> tuple[Adjustments, list[tuple[str, float]]]:
    """The calibration stage's adjustments (none where the run does not calibrate) and its seconds; GPTQ's codes
    are kept in a scratch folder beside OUT that `scratch` removes."""
    gptq = _sequential_gptq(source, plan, options, out, scratch)
    adjustments, phases = Adjustments(), []
    # A dry run calibrates only to show static input scales; otherwise the steps chosen decide.
    agree_source(source)  # of several processes, every one reads what process 0 reads
    steps = [] if options.dry_run and (not options.static_act or plan.refusal) else choose_steps(
        source, options, plan.quantized_modules, gptq, plan.flags)
    if steps:
        calibration_started = time.perf_counter()
        with stage("calibration"):
            adjustments = prepare_adjustments(source, options, steps, message, gptq)
        if adjustments.calibration_record is not None:
            phases.append(("calibrated", time.perf_counter() - calibration_started))
    if options.static_act and not plan.refusal:
        _check_input_scales(plan, adjustments.input_scales or {})
    return adjustments, phases


def _write(source: SourceModel, out: Path, plan: ConversionPlan, options: ConvertOptions, adjustments: Adjustments,
           progress: Progress | None) -> tuple[dict[str, str], list[tuple[str, float]]]:
    """OUT written with the calibration's adjustments (not for a dry run): the files' sha256 and the seconds."""
    if not _writes(options):
        return {}, []
    writing_started = time.perf_counter()
    files = write_output(source, out, plan, options, _calibrated(adjustments, options),
                         _record(source, plan, options, adjustments, out), progress)
    return files, [("wrote", time.perf_counter() - writing_started)]


def _calibrated(adjustments: Adjustments, options: ConvertOptions) -> Calibrated:
    """What the writer takes of the calibration stage's adjustments for the tensors: the smoothing transform,
    static input scales, the clip searches (with the clips handed in) and GPTQ's codes."""
    return Calibrated(
        weight_transform=adjustments.transform, input_scales=adjustments.input_scales or {},
        searches=ScaleSearches(options.searches_scales, dict(adjustments.weight_clip),
                               dict(adjustments.search_records)),
        quantized=adjustments.quantized, extra_tensors=dict(adjustments.extra_tensors),
        extra_config=dict(adjustments.extra_config))


def _record(source: SourceModel, plan: ConversionPlan, options: ConvertOptions,
            adjustments: Adjustments, out: Path) -> ConversionRecord:
    """qconvert.json as far as it is known before writing (the writer adds the source, scale searches, files);
    a calibration file by its name, and where it lies from OUT (no local path is published)."""
    return ConversionRecord(
        options.scheme, {}, qconvert_version=__version__, flags=options.recorded_flags(plan.flags),
        calibration=placed_record(adjustments.calibration_record, out), smoothing=adjustments.smoothing_record,
        rounding=adjustments.rounding_record or dict(RTN_RECORD),
        weight_only=source.weight_only.record() if source.weight_only is not None else None,
        kv_cache=adjustments.records.get("kv_cache"))


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


def agree_run(options: ConvertOptions, out: Path) -> None:
    """In a run of several processes, before anything else: the same conversion on every process, every field
    of the options object and OUT (exit 2 naming the first that differs: the processes' collectives would not
    match). The CLI's join compared the command's flags already; this holds for any caller of convert()."""
    if cluster.active():
        from qconvert.cluster.settings import options_settings
        from qconvert.options import GIVEN_ONLY_OPTIONS  # fields recorded under their flag's name

        cluster.agree_settings(options_settings(options, out, GIVEN_ONLY_OPTIONS), "conversion")


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
