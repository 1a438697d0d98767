"""`qconvert verify` as a function: integrity, then per-layer and whole-model checks, into one report."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.consistency import check_weights_match_config
from qconvert.formats.errors import FormatError, UsageError
from qconvert.formats.layouts import open_quantized
from qconvert.formats.safetensors_io import open_checkpoint, sha256_file
from qconvert.hub import ResolvedModel, resolve_model
from qconvert.models import read_tensors
from qconvert.models.registry import family_for
from qconvert.models.weight_only import check_architecture, checkpoint_family
from qconvert.progress import Reporter, as_reporter
from qconvert.schemes import names_where, scheme_named
from qconvert.verify.integrity import (ConversionRecord, IntegrityResult, check_config, check_loader_view,
                                       check_config_matches_reference, check_files, read_config, read_record)
from qconvert.verify.fidelity import make_folder_linear
from qconvert.verify.held_out import AUTO, HeldOut, held_out_evaluation
from qconvert.verify.kernel_path import make_quantized_linear
from qconvert.verify.layers import smoothing_factors, verify_layers
from qconvert.verify.model import verify_model
from qconvert.formats.checkpoint_params import CheckpointParams
from qconvert.verify.params import QuantizedParams, check_tensors
from qconvert.verify.report import versions
from qconvert.verify.results import VerifyReport
from qconvert.verify.thresholds import Check, thresholds_for
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


def evaluation_tokens(options: VerifyOptions, reference_folder: Path, config: dict[str, Any],
                      calibration: dict[str, Any] | None = None) -> HeldOut:
    """The evaluation windows, held out from the calibration text qconvert.json records (verify/held_out.py)."""
    samples = options.samples or (QUICK_SAMPLES if options.quick else DEFAULT_SAMPLES)
    seqlen = options.seqlen or (QUICK_SEQLEN if options.quick else DEFAULT_SEQLEN)
    return held_out_evaluation(options.calib, calibration, reference_folder, config, samples, seqlen)


def check_backend(backend: str) -> None:
    """--backend tpu/gpu needs that platform (cpu interprets the TPU kernels anywhere, xla runs anywhere);
    UsageError if absent."""
    platform = jax.default_backend()
    if backend not in (AUTO, "cpu", "xla", "tpu", "gpu"):
        raise UsageError(f"unknown --backend {backend!r}; choose auto, tpu, gpu, cpu or xla")
    if backend in ("tpu", "gpu") and platform.replace("cuda", "gpu").replace("rocm", "gpu") != backend:
        raise UsageError(f"--backend {backend} needs a {backend.upper()}, but JAX runs on {platform}; "
                         "use --backend auto, xla or cpu")


def check_source_unchanged(folder: Path, recorded: Mapping[str, str]) -> None:
    """The recorded source still has the bytes it was converted from; UsageError naming the file if not."""
    for name, digest in sorted(recorded.items()):
        path = Path(folder) / name
        if path.is_file() and sha256_file(path) != digest:
            raise UsageError(f"the source {folder} changed since the conversion ({name}: sha256 differs "
                             "from qconvert.json); pass --reference with the original float model")


def resolve_reference(record: ConversionRecord, options: VerifyOptions) -> tuple[str, ResolvedModel]:
    """(model id, ResolvedModel) of the float reference: --reference, else the source qconvert.json records.

    UsageError when there is none, or when the recorded source changed since the conversion.
    """
    reference_id = options.reference or record.source_model
    if not reference_id:
        raise UsageError("qconvert.json records no source model; pass --reference MODEL")
    # A folder converted weight-only with --any-architecture has a reference of no known family.
    check = (functools.partial(check_architecture, any_architecture=True, scheme=record.scheme,
                               weight_only=scheme_named(record.scheme).weight_only,
                               weight_only_schemes=names_where(lambda s: s.weight_only))
             if _weight_only(record) else family_for)
    if options.reference:
        return reference_id, resolve_model(reference_id, options.revision, check_architecture=check)
    source = record.raw.get("source", {})
    # A Hub source is pinned to the commit it was converted from; a local folder has no revision.
    resolved = resolve_model(reference_id, record.source_revision if source.get("is_hub") else None,
                             check_architecture=check)
    check_source_unchanged(resolved.folder, source.get("files") or {})
    return reference_id, resolved


def _layer_steps(progress: Reporter, stage: str, num_layers: int):
    """An on_layer callback that reports `stage` layer by layer (starting the stage's bar now)."""
    progress.step(stage, 0, num_layers)
    return lambda index: progress.step(stage, index + 1, num_layers)


def _weight_only(record: ConversionRecord) -> bool:
    return isinstance(record.raw.get("weight_only"), dict)


def _integrity_only(folder, scheme, options, thresholds, files, problems, started) -> VerifyReport:
    return VerifyReport(
        folder=str(folder), scheme=scheme, reference={}, backend=options.backend,
        devices=tuple(str(d) for d in jax.devices()), thresholds=thresholds,
        integrity=IntegrityResult(tuple(files), tuple(problems)), layers=(), model=None,
        extra_checks=(), evaluation={}, versions=versions(), seconds=time.perf_counter() - started)


def verify_folder(folder, options: VerifyOptions = VerifyOptions(), progress: Reporter | None = None
                  ) -> VerifyReport:
    """Verify a folder written by `qconvert quantize`; the report says what passed and what did not.

    Raises QConvertError subclasses for bad input (no qconvert.json, an
    unreachable reference, bad flags); a folder that is wrong in itself (hashes,
    tensors, numbers) yields a failing report instead. The thresholds are the
    scheme's whatever the rounding (GPTQ or round-to-nearest); the report names it.
    `progress` hears each stage's steps: integrity, then the layers of the
    per-linear and whole-model passes.
    """
    started = time.perf_counter()
    check_backend(options.backend)
    folder = Path(folder)
    record = read_record(folder)
    report = _verify_folder(folder, record, options, as_reporter(progress), started)
    return dataclasses.replace(report, rounding=rounding_of(record))


def rounding_of(record) -> dict[str, Any]:
    """The rounding a qconvert.json records, without its per-linear errors (a record without one: "rtn")."""
    rounding = record.raw.get("rounding")
    if not isinstance(rounding, dict) or not isinstance(rounding.get("method"), str):
        return {"method": "rtn"}
    return {k: v for k, v in rounding.items() if k != "modules"}


def _verify_folder(folder: Path, record: ConversionRecord, options: VerifyOptions, progress: Reporter,
                   started: float) -> VerifyReport:
    # Until config.json's quantization_config is read, the strictest (dynamic) thresholds stand.
    thresholds = thresholds_for(record.scheme, "dynamic", **dict(options.thresholds))
    files = sorted(record.files)
    progress.step(INTEGRITY, 0, 2, "checks")
    problems = check_files(folder, record)
    progress.step(INTEGRITY, 1, 2, "checks")
    config = read_config(folder) if (folder / "config.json").is_file() else {}
    if config:
        problems += check_config(config, record)
    if problems:
        return _integrity_only(folder, record.scheme, options, thresholds, files, problems, started)
    try:
        quantized = open_quantized(folder)
    except FormatError as exc:
        return _integrity_only(folder, record.scheme, options, thresholds, files, [str(exc)], started)
    problems = check_loader_view(quantized)
    if problems:
        return _integrity_only(folder, record.scheme, options, thresholds, files, problems, started)
    # The activation mode, and with it the thresholds, follow from config.json's quantization_config, which
    # qconvert.json's hashes cover; the record's own flags are not hashed, so they must agree with it.
    act = "static" if quantized.flags.static_act else "dynamic"
    recorded_act = (record.raw.get("flags") or {}).get("act", "dynamic")
    if recorded_act != act:
        return _integrity_only(folder, record.scheme, options, thresholds, files, [
            f"qconvert.json: flags.act is {recorded_act!r}, but config.json's quantization_config describes "
            f"{act} activations"], started)
    thresholds = thresholds_for(record.scheme, act, **dict(options.thresholds))

    reference_id, resolved = resolve_reference(record, options)
    reference_ckpt = open_checkpoint(resolved.folder)
    arch, weight_only = checkpoint_family(config, reference_ckpt, any_architecture=_weight_only(record))
    model = None
    if weight_only is None:  # a reference whose config misfits: one line
        model = check_weights_match_config(reference_ckpt, resolved.config)
    problems = check_config_matches_reference(config, resolved.config) + check_tensors(
        quantized, reference_ckpt, config, arch)
    if problems:
        return _integrity_only(folder, record.scheme, options, thresholds, files, problems, started)
    progress.step(INTEGRITY, 2, 2, "checks")
    reference_info = {"model": reference_id, "folder": str(resolved.folder), "commit": resolved.commit,
                      "is_hub": resolved.is_hub, "from": "--reference" if options.reference else "qconvert.json"}
    if weight_only is not None:
        return _verify_weight_only(folder, record, options, thresholds, files, quantized, reference_ckpt,
                                   resolved, reference_info, weight_only.architecture, started)

    if resolved.family is not arch:
        raise UsageError(f"the reference {reference_id} is a {resolved.config.get('architectures')} model, "
                         f"the converted folder a {config.get('architectures')} one; pass the right --reference")
    # `model` is the reference's forward; the folder's config was found equal to it above.
    reference = CheckpointParams(reference_ckpt)
    converted = QuantizedParams(quantized)
    held_out = evaluation_tokens(options, resolved.folder, resolved.config, record.raw.get("calibration"))
    data = held_out.data
    ids = np.asarray(data.input_ids)
    mask = np.ones_like(ids)
    quantized_linear, choices = make_quantized_linear(quantized, record.scheme, options.backend)
    smoothing_record = record.raw.get("smoothing") or {}
    smoothed_sources = sorted((smoothing_record.get("groups") or {}).keys())
    smoothing = smoothing_factors(model, config, reference, converted, smoothed_sources)
    layer_results, float_hidden = verify_layers(model, reference, converted, ids, mask, quantized.quantized_modules,
                                  quantized_linear, thresholds, smoothing=smoothing,
                                  batch_size=options.batch_size,
                                  folder_linear=make_folder_linear(quantized, record.scheme),
                                  on_layer=_layer_steps(progress, PER_LINEAR, model.num_layers))
    causal_lm = arch.causal_lm
    float_output = model.head(read_tensors(reference, model.head_tensor_names()), float_hidden,
                              jnp.asarray(mask))
    model_result = verify_model(model, reference, converted, ids, mask, quantized_linear, thresholds,
                                causal_lm=causal_lm, batch_size=options.batch_size,
                                float_output=float_output,
                                on_layer=_layer_steps(progress, WHOLE_MODEL, model.num_layers))
    extra: list[Check] = []
    if options.strict:
        # --strict: a layer that ran through the reference instead of a Pallas kernel fails.
        for r in layer_results:
            extra.append(Check("pallas_kernel", r.name, float(r.kernel.pallas), 1.0, "min", r.kernel.pallas))
    backends = sorted({r.kernel.backend for r in layer_results})
    return VerifyReport(
        folder=str(folder), scheme=record.scheme,
        reference=reference_info,
        backend=",".join(backends) if backends else options.backend,
        devices=tuple(str(d) for d in jax.devices()), thresholds=thresholds,
        integrity=IntegrityResult(tuple(files), ()), layers=tuple(layer_results), model=model_result,
        extra_checks=tuple(extra),
        evaluation={**data.record(), "quick": options.quick, "kernel_calls": len(choices),
                    "held_out": held_out.record()},
        versions=versions(), seconds=time.perf_counter() - started)


def _verify_weight_only(folder, record, options, thresholds, files, quantized, reference_ckpt, resolved,
                        reference_info, architecture: str, started) -> VerifyReport:
    """Integrity passed; per layer on synthetic inputs, no whole-model stage (no forward pass exists)."""
    if resolved.config.get("architectures") != [architecture]:
        raise UsageError(f"the reference {reference_info['model']} is a {resolved.config.get('architectures')} "
                         f"model, the converted folder a {architecture} one; pass the right --reference")
    quantized_linear, choices = make_quantized_linear(quantized, record.scheme, options.backend)
    layer_results = verify_linears_on_synthetic_inputs(
        CheckpointParams(reference_ckpt), QuantizedParams(quantized), quantized.quantized_modules,
        quantized_linear, thresholds, folder_linear=make_folder_linear(quantized, record.scheme))
    extra = [Check("pallas_kernel", r.name, float(r.kernel.pallas), 1.0, "min", r.kernel.pallas)
             for r in layer_results] if options.strict else []
    backends = sorted({r.kernel.backend for r in layer_results})
    return VerifyReport(
        folder=str(folder), scheme=record.scheme, reference=reference_info,
        backend=",".join(backends) if backends else options.backend,
        devices=tuple(str(d) for d in jax.devices()), thresholds=thresholds,
        integrity=IntegrityResult(tuple(files), ()), layers=tuple(layer_results), model=None,
        extra_checks=tuple(extra),
        evaluation={"source": "synthetic", "rows": SYNTHETIC_ROWS, "seed": SYNTHETIC_SEED,
                    "kernel_calls": len(choices)},
        versions=versions(), seconds=time.perf_counter() - started, skipped=skipped_stages(architecture))
