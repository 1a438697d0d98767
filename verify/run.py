"""`qconvert verify` as a pipeline of stages, each a function of the run so far.

    read the record -> check the folder alone (hashes, config, loader's view) -> open the reference
    (source.py, pinned to the recorded commit, closed when done) -> check the folder against it (config,
    tensors, smoothing scales) -> per linear and whole model on held-out text (or, for a weight-only
    folder of an unknown family, per linear on synthetic rows) -> one report.

A stage that finds the folder wrong records its problems and the run goes
straight to the report (a failing one); bad input (no qconvert.json, an
unreachable reference, bad flags) raises a QConvertError subclass instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import FormatError, UsageError
from qconvert.formats.layouts import QuantizedCheckpoint, open_quantized
from qconvert.formats.record import ConversionRecord
from qconvert.formats.safetensors_io import sha256_file
from qconvert.kernels.backends import deployment_backends
from qconvert.kernels.plan import platform, resolve_backend
from qconvert.calibration.layers import read_tensors
from qconvert.progress import Reporter, as_reporter
from qconvert.schemes import scheme_named
from qconvert.source.resolve import SourceModel, open_source, resolve_source
from qconvert.verify.fidelity import make_folder_linear
from qconvert.verify.held_out import AUTO, HeldOut, held_out_evaluation
from qconvert.verify.integrity import (IntegrityResult, check_config, check_config_matches_reference, check_files,
                                       check_loader_view, check_quantization_config, read_config, read_record)
from qconvert.verify.kernel_path import KernelPath
from qconvert.verify.layers import verify_layers
from qconvert.verify.model import verify_model
from qconvert.verify.params import QuantizedParams, check_tensors
from qconvert.verify.report import versions
from qconvert.verify.results import LayerResult, ModelResult, VerifyReport
from qconvert.verify.kv_cache import check_kv_scales, fp8_cache_tap
from qconvert.verify.smoothing import check_record_has_scales, check_smoothing, smoothing_factors
from qconvert.calibration.observer import check_calibration_fits
from qconvert.verify.thresholds import Check, Thresholds, thresholds_for
from qconvert.verify.weight_only import (SYNTHETIC_ROWS, SYNTHETIC_SEED, skipped_stages,
                                         verify_linears_on_synthetic_inputs)

# verify's stages, as the progress bars name them.
INTEGRITY, PER_LINEAR, WHOLE_MODEL = "integrity", "per linear", "whole model"
# Evaluation sizes: the full run and --quick. Small on purpose: on CPU the Pallas
# kernels run in interpret mode, and a few thousand tokens already resolve
# SQNR to a fraction of a dB.
DEFAULT_SAMPLES, DEFAULT_SEQLEN = 8, 64
QUICK_SAMPLES, QUICK_SEQLEN = 2, 32


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """What `qconvert verify` was asked to do."""

    reference: str | None = None
    revision: str | None = None
    calib: str = AUTO
    samples: int | None = None
    seqlen: int | None = None
    quick: bool = False
    backend: str = AUTO
    strict: bool = False
    batch_size: int | None = None
    thresholds: Mapping[str, float | None] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Run:
    """One verification as its stages fill it in; `report` turns it into the VerifyReport."""

    folder: Path
    options: VerifyOptions
    record: ConversionRecord
    thresholds: Thresholds
    started: float
    problems: list[str] = dataclasses.field(default_factory=list)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    quantized: QuantizedCheckpoint | None = None
    converted: QuantizedParams | None = None  # the folder as params, and its kernels: once it opens
    kernels: KernelPath | None = None
    reference: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: tuple[LayerResult, ...] = ()
    model: ModelResult | None = None
    evaluation: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped: tuple[str, ...] = ()


def verify_folder(folder, options: VerifyOptions = VerifyOptions(), progress: Reporter | None = None
                  ) -> VerifyReport:
    """Verify a folder written by `qconvert quantize`; the report says what passed and what did not.

    The thresholds are the scheme's whatever the rounding (GPTQ or round-to-nearest);
    the report names it. `progress` hears each stage's steps: integrity, then the
    layers of the per-linear and whole-model passes.
    """
    check_backend(options.backend)
    if options.strict and resolve_backend(options.backend) in ("xla", "reference"):
        # Every layer would run XLA's reference and fail --strict: say what to pass instead.
        raise UsageError(f"--strict fails every layer that runs XLA's reference instead of a Pallas kernel, and "
                         f"--backend {options.backend} runs XLA's here ({jax.default_backend()}); pass --backend cpu "
                         "(the Pallas kernels, interpreted) with --strict on a CPU")
    record = read_record(folder)
    check_record_has_scales(record)
    run = Run(Path(folder), options, record, thresholds_for(record.scheme, "dynamic", **dict(options.thresholds)),
              time.perf_counter())
    progress = as_reporter(progress)
    if check_folder(run, progress):
        with open_reference(run) as source:
            if check_against_reference(run, source):
                progress.step(INTEGRITY, 2, 2, "checks")
                (verify_weight_only if source.weight_only is not None else verify_on_text)(run, source, progress)
    return report(run)


def backend_choices() -> list[str]:
    """The kernel backends verify takes (--backend): every one but the reference, which is no deployment kernel."""
    return deployment_backends()


def check_backend(backend: str) -> None:
    """--backend tpu/gpu needs that platform (cpu interprets the TPU kernels anywhere, xla runs anywhere);
    UsageError if absent."""
    choices = backend_choices()
    if backend not in choices:
        raise UsageError(f"unknown --backend {backend!r}; choose {', '.join(choices[:-1])} or {choices[-1]}")
    if backend in ("tpu", "gpu") and platform() != backend:
        raise UsageError(f"--backend {backend} needs a {backend.upper()}, but JAX runs on "
                         f"{jax.default_backend()}; use --backend auto, xla or cpu")


def check_folder(run: Run, progress: Reporter) -> bool:
    """Integrity from the folder alone: the recorded hashes, config.json against the record, the folder as
    its loader reads it, and the recorded activation mode against config.json's. The thresholds follow."""
    progress.step(INTEGRITY, 0, 2, "checks")
    run.problems = check_files(run.folder, run.record)
    progress.step(INTEGRITY, 1, 2, "checks")
    if (run.folder / "config.json").is_file():
        run.config = read_config(run.folder)
        run.problems += check_config(run.config, run.record)
    if run.problems:
        return False
    try:
        run.quantized = open_quantized(run.folder)
    except FormatError as exc:
        run.problems.append(str(exc))
        return False
    run.problems += (check_loader_view(run.quantized) or check_activation_mode(run.record, run.quantized)
                     or check_quantization_config(run.config, run.record)  # the most general of these
                     or check_kv_scales(run.record.kv_cache, run.quantized))
    if run.problems:
        return False
    run.converted, run.kernels = QuantizedParams(run.quantized), KernelPath(run.quantized, run.options.backend)
    run.thresholds = thresholds_for(run.record.scheme, run.record.act, **dict(run.options.thresholds))
    return True


def check_activation_mode(record: ConversionRecord, quantized: QuantizedCheckpoint) -> list[str]:
    """qconvert.json's flags are not hashed, so the activation mode they record must be the one config.json's
    quantization_config (which the hashes cover) describes."""
    act = "static" if quantized.flags.static_act else "dynamic"
    if record.act == act:
        return []
    return [f"qconvert.json: flags.act is {record.act!r}, but config.json's quantization_config describes "
            f"{act} activations"]


def open_reference(run: Run) -> SourceModel:
    """The float reference, opened (a context manager): --reference, else the source qconvert.json records,
    pinned to the recorded commit and checked unchanged since the conversion."""
    options, source = run.options, run.record.source
    model = options.reference or source.model
    if not model:
        raise UsageError("qconvert.json records no source model; pass --reference MODEL")
    weight_only = run.record.weight_only is not None  # a reference of no known family (--any-architecture)
    scheme = scheme_named(run.record.scheme) if weight_only else None
    # A Hub source is pinned to the commit it was converted from; a local folder has no revision.
    revision = options.revision if options.reference else (source.pinned_revision if source.is_hub else None)
    if not options.reference and not source.is_hub:
        model = str(recorded_source_folder(run.folder, source))  # a local source is never looked up on the Hub
    resolved = resolve_source(model, revision, scheme=scheme, any_architecture=weight_only)
    if not options.reference:
        check_source_unchanged(resolved.folder, source.files)
    run.reference = {"model": model, "folder": str(resolved.folder), "commit": resolved.commit,
                     "is_hub": resolved.is_hub, "from": "--reference" if options.reference else "qconvert.json"}
    reference = open_source(resolved, any_architecture=weight_only)
    # A quantized reference (block FP8, compressed-tensors FP8) is read dequantized, as quantize read it.
    run.reference["format"] = reference.source_format.name if reference.source_format else None
    run.reference["quantized"] = reference.source_format is not None
    return reference


def recorded_source_folder(folder: Path, source) -> Path:
    """The local folder qconvert.json records as the source: where it lies from OUT (or, in records without
    that, the path as it was typed); UsageError naming --reference when it is not there."""
    where = Path(folder) / source.folder_from_out if source.folder_from_out else Path(str(source.model))
    if not where.is_dir():
        said = (f"{source.folder_from_out} from {folder}" if source.folder_from_out else str(source.model))
        raise UsageError(f"the source folder qconvert.json records ({said}) is not there; pass --reference with "
                         "the float model the folder was converted from")
    return where


def check_source_unchanged(folder: Path, recorded: Mapping[str, str]) -> None:
    """The recorded source still has the bytes it was converted from; UsageError naming the file if not."""
    for name, digest in sorted(recorded.items()):
        path = Path(folder) / name
        if path.is_file() and sha256_file(path) != digest:
            raise UsageError(f"the source {folder} changed since the conversion ({name}: sha256 differs "
                             "from qconvert.json); pass --reference with the original float model")


def check_against_reference(run: Run, source: SourceModel) -> bool:
    """The folder against the reference: the same config, every tensor the layout needs, and the smoothed
    tensors exactly the reference's with the recorded scales folded in. A reference whose own config does
    not fit its weights is bad input (one line), not a failed folder."""
    if source.weight_only is None:
        source.check_weights()
    run.problems += check_config_matches_reference(run.config, source.config) + check_tensors(
        run.quantized, source.checkpoint, run.config, source.family)
    if not run.problems:
        run.problems += check_smoothing(run.record.smoothing, source.params, run.converted)
    return not run.problems


def evaluation_tokens(options: VerifyOptions, reference_folder: Path, config: dict[str, Any],
                      calibration: dict[str, Any] | None = None, out: Path | None = None) -> HeldOut:
    """The evaluation windows, held out from the calibration text OUT's qconvert.json records
    (verify/held_out.py)."""
    samples = options.samples or (QUICK_SAMPLES if options.quick else DEFAULT_SAMPLES)
    seqlen = options.seqlen or (QUICK_SEQLEN if options.quick else DEFAULT_SEQLEN)
    return held_out_evaluation(options.calib, calibration, reference_folder, config, samples, seqlen, out)


def verify_on_text(run: Run, source: SourceModel, progress: Reporter) -> None:
    """Per linear on the float model's own activations, then the whole model, on held-out text."""
    model, converted = source.model, run.converted  # the reference's forward: the configs were found equal
    options = run.options
    check_calibration_fits(model, source.params, source.config,
                           options.samples or (QUICK_SAMPLES if options.quick else DEFAULT_SAMPLES),
                           options.seqlen or (QUICK_SEQLEN if options.quick else DEFAULT_SEQLEN),
                           what="verifying", flags="--samples or a shorter --seqlen")  # before any window
    held_out = evaluation_tokens(run.options, source.folder, source.config, run.record.calibration,
                                 run.folder)
    ids = np.asarray(held_out.data.input_ids)
    mask = np.ones_like(ids)
    layers, float_hidden = verify_layers(
        model, source.params, converted, ids, mask, run.quantized.quantized_modules, run.kernels, run.thresholds,
        smoothing=smoothing_factors(run.record.smoothing, source.params, converted),
        batch_size=run.options.batch_size, folder_linear=make_folder_linear(run.quantized, run.record.scheme),
        on_layer=_layer_steps(progress, PER_LINEAR, model.num_layers))
    float_output = model.head(read_tensors(source.params, model.head_tensor_names()), float_hidden,
                              jnp.asarray(mask))
    run.model = verify_model(model, source.params, converted, ids, mask, run.kernels, run.thresholds,
                             causal_lm=source.family.causal_lm, batch_size=run.options.batch_size,
                             float_output=float_output, kv_cache=fp8_cache_tap(run.quantized, run.record.kv_cache),
                             on_layer=_layer_steps(progress, WHOLE_MODEL, model.num_layers))
    run.layers = tuple(layers)
    run.evaluation = {**held_out.data.record(), "quick": run.options.quick, "kernel_calls": len(run.kernels.choices),
                      "held_out": held_out.record()}


def verify_weight_only(run: Run, source: SourceModel, progress: Reporter) -> None:
    """A family qconvert has no forward for: per linear on synthetic rows; no whole-model stage."""
    del progress
    run.layers = tuple(verify_linears_on_synthetic_inputs(
        source.params, run.converted, run.quantized.quantized_modules, run.kernels,
        run.thresholds, folder_linear=make_folder_linear(run.quantized, run.record.scheme)))
    run.evaluation = {"source": "synthetic", "rows": SYNTHETIC_ROWS, "seed": SYNTHETIC_SEED,
                      "kernel_calls": len(run.kernels.choices)}
    run.skipped = skipped_stages(source.weight_only.architecture)


def _layer_steps(progress: Reporter, stage: str, num_layers: int):
    """An on_layer callback that reports `stage` layer by layer (starting the stage's bar now)."""
    progress.step(stage, 0, num_layers)
    return lambda index: progress.step(stage, index + 1, num_layers)


def rounding_of(record: ConversionRecord) -> dict[str, Any]:
    """The rounding a qconvert.json records, without its per-linear errors (a record without one: "rtn")."""
    rounding = record.rounding
    if rounding is None or not isinstance(rounding.get("method"), str):
        return {"method": "rtn"}
    return {k: v for k, v in rounding.items() if k != "modules"}


def report(run: Run) -> VerifyReport:
    """The one VerifyReport of a run, however far it got (an integrity failure has no layers and no model)."""
    extra = tuple(Check("pallas_kernel", r.name, float(r.kernel.pallas), 1.0, "min", r.kernel.pallas)
                  for r in run.layers) if run.options.strict else ()  # --strict: a reference fallback fails
    backends = sorted({r.kernel.backend for r in run.layers})
    return VerifyReport(
        folder=str(run.folder), scheme=run.record.scheme,
        reference=run.reference if not run.problems else {},
        backend=",".join(backends) if backends else run.options.backend,
        devices=tuple(str(d) for d in jax.devices()), thresholds=run.thresholds,
        integrity=IntegrityResult(tuple(sorted(run.record.files)), tuple(run.problems)), layers=run.layers,
        model=run.model, extra_checks=extra, evaluation=run.evaluation, versions=versions(),
        seconds=time.perf_counter() - run.started, skipped=run.skipped, rounding=rounding_of(run.record),
        thresholds_given={k: float(v) for k, v in sorted(run.options.thresholds.items()) if v is not None})
