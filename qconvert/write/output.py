"""OUT written: the streamed tensors in shards, config.json with the scheme's quantization_config, the side files,
the model card and qconvert.json, in a folder staged beside OUT and renamed into place.

`plan` below is the run's qconvert.plan.ConversionPlan, `options` its qconvert.options.ConvertOptions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from qconvert.formats.jsonfile import write_json
from qconvert.formats.layout_base import FLOAT_DTYPES_BY_NAME
from qconvert.formats.record import ConversionRecord, write_record
from qconvert.formats.safetensors_writer import TensorSpec, write_shards
from qconvert.source.resolve import SourceModel
from qconvert.stages import stage
from qconvert.write.card import CARD_NAME, CardFacts, write_card
from qconvert.write.folder import staged_output
from qconvert.write.inputs import hash_in_background, input_files, source_record
from qconvert.write.side_files import copy_side_files
from qconvert.write.tensors import Calibrated, Progress, output_specs, stream_tensors


def write_output(source: SourceModel, out: Path, plan, options, calibrated: Calibrated, record: ConversionRecord,
                 progress: Progress | None) -> dict[str, str]:
    """Write the planned tensors, config.json, the side files, the card and qconvert.json beside OUT, then rename
    into place; the files' sha256.

    `record` is qconvert.json as far as it is known before writing: its source (with the inputs' sha256,
    hashed meanwhile), its scale searches and its files are filled in here.
    """
    resolved, ckpt, scheme = source.resolved, source.checkpoint, options.scheme_object
    files: dict[str, str] = {}
    source_hashes = hash_in_background(resolved.folder, input_files(resolved.folder, ckpt))
    with stage("writing the output"), staged_output(out, options.overwrite) as staging:
        specs = output_specs(plan, calibrated)
        stream = stream_tensors(ckpt, plan, scheme, calibrated, progress, options.workers)
        try:
            files.update(write_shards(staging, specs, stream, options.max_shard_size))
        finally:
            stream.close()  # stops the worker at once if writing failed
        files.update(copy_side_files(resolved.folder, staging))
        files["config.json"] = write_json(staging / "config.json",
                                          quantized_config(resolved.config, plan, scheme, calibrated.extra_config))
        record = dataclasses.replace(
            record, source=source_record(resolved, out, source_hashes(), source.source_format),
            scale_search=calibrated.searches.record(scheme) if calibrated.searches is not None else None)
        files[CARD_NAME] = write_card(staging, card_facts(source, plan, options, record, specs))
        write_record(staging, dataclasses.replace(record, files=dict(sorted(files.items()))))
    return dict(sorted(files.items()))


def quantized_config(config: dict[str, Any], plan, scheme, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The source config.json with the scheme's quantization_config added (with the keys calibration adds to it:
    the KV cache's kv_cache_scheme)."""
    declared = config.get("torch_dtype") or config.get("dtype")
    compute_dtype = declared if declared in tuple(FLOAT_DTYPES_BY_NAME) else plan.float_dtype
    return {**config, "quantization_config": {**scheme.layout.quantization_config(
        plan.flags, tuple(plan.ignore), compute_dtype), **(extra or {})}}


def card_facts(source: SourceModel, plan, options, record: ConversionRecord, specs: list[TensorSpec]) -> CardFacts:
    """What the model card says: the record (less its file hashes), the scheme, the family and the sizes."""
    scheme, ckpt = options.scheme_object, source.checkpoint
    return CardFacts(
        record=record, quant_method=scheme.layout.quant_method,
        scheme_summary=scheme.summary, loads_in=scheme.loads_in, vllm_loads=scheme.vllm_loads,
        servers=scheme.servers(plan.flags, source.config, kv_cache=record.kv_cache is not None),
        causal_lm=source.family.causal_lm or source.weight_only is not None,
        architecture=", ".join(source.config.get("architectures") or ["a model"]),
        quantized_linears=len(plan.quantized_modules),
        unchanged_tensors=sum(t.module is None for t in plan.tensors),
        input_bytes=sum(ckpt.nbytes(name) for name in ckpt.tensor_names),
        output_bytes=sum(spec.nbytes for spec in specs), pip_packages=scheme.layout.pip_packages,
        act_applies=bool(scheme.act_modes), repo=options.card_repo,
        transformers_quantization_config=scheme.layout.transformers_quantization_config,
        transformers_dtype=scheme.layout.transformers_dtype)
