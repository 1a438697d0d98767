"""Integrity of a converted folder: file hashes against qconvert.json, config against the tensors.

Everything here reads bytes and headers only; no tensor math. Each problem is one
line that names the file (and tensor) at fault, so a CI log says what to look at.
qconvert.json itself (its name, reading, hashing) is formats/record.py's; this
module words what verify reports.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from qconvert.formats.errors import FormatError, InvalidCheckpointError, require_converted_folder
from qconvert.formats.jsonfile import read_config as read_folder_config
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layouts import QuantizedCheckpoint, layout_for_config
from qconvert.formats.record import (
    NO_FILES,
    NO_RECORD,
    RECORD_NAME,
    ConversionRecord,
    RecordError,
    check_hashes,
)
from qconvert.formats.record import read_record as _read_record
from qconvert.models.module_roles import expert_count, head_name, is_conv1d, is_expert, is_router
from qconvert.plan import linear_candidates

__all__ = ["RECORD_NAME", "ConversionRecord", "IntegrityResult", "check_config", "check_files", "check_loader_view",
           "read_config", "read_record"]


@dataclasses.dataclass(frozen=True)
class IntegrityResult:
    """What the integrity stage looked at and what it found wrong (empty when all is well)."""

    files_checked: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "files_checked": list(self.files_checked),
                "problems": list(self.problems)}


def read_record(folder: Path) -> ConversionRecord:
    """Parse folder/qconvert.json; InvalidCheckpointError when it is missing or malformed."""
    require_converted_folder(folder)
    try:
        record = _read_record(folder)
    except RecordError as exc:
        path = exc.path
        if exc.kind == NO_RECORD:
            raise InvalidCheckpointError(
                f"{path}: missing; verify takes a folder written by `qconvert quantize`") from None
        if exc.kind == NO_FILES:
            raise InvalidCheckpointError(
                f"{path}: no \"files\" map of sha256 hashes; re-run `qconvert quantize`") from None
        raise InvalidCheckpointError(f"{path}: not valid JSON ({exc.cause})") from exc
    if record.scheme is None:
        raise InvalidCheckpointError(f"{Path(folder) / RECORD_NAME}: no \"scheme\"; re-run `qconvert quantize`")
    return record


def check_files(folder: Path, record: ConversionRecord) -> list[str]:
    """Every recorded file exists with its recorded sha256; no unrecorded weight file lies beside them."""
    folder = Path(folder)
    problems = []
    for check in check_hashes(folder, record):
        if check.outside:
            problems.append(f"{RECORD_NAME}: lists {check.name!r}, a path outside the folder")
        elif check.actual is None:
            problems.append(f"{check.name}: missing (qconvert.json records it)")
        elif not check.ok:
            problems.append(
                f"{check.name}: sha256 mismatch (recorded {check.expected[:12]}..., found "
                f"{check.actual[:12]}...); the file changed after conversion"
            )
    # A stray shard would be picked up by loaders that glob *.safetensors (some look in subfolders too).
    for path in sorted(folder.rglob("*.safetensors")):
        name = path.relative_to(folder).as_posix()
        if name not in record.files:
            problems.append(f"{name}: not recorded in qconvert.json (a stray or renamed shard)")
    if "config.json" not in record.files:
        problems.append(f"{RECORD_NAME}: does not record config.json")
    return problems


def read_config(folder: Path) -> dict[str, Any]:
    """Parse folder/config.json; InvalidCheckpointError when missing or malformed."""
    return read_folder_config(folder, missing="give the output folder of `qconvert quantize`",
                              broken="re-run `qconvert quantize` to rewrite it")


def check_config(config: dict[str, Any], record: ConversionRecord) -> list[str]:
    """config.json's quantization_config is present and describes the scheme qconvert.json records."""
    qconfig = config.get("quantization_config")
    if not isinstance(qconfig, dict):
        return ["config.json: no quantization_config; loaders would read the folder as a float model"]
    try:
        described = layout_for_config(qconfig)[0].scheme
    except ValueError:
        described = None
    if described != record.scheme:
        return [
            f"config.json: quantization_config describes {described or 'no known scheme'}, "
            f"but qconvert.json records scheme {record.scheme!r}"
        ]
    return []


def check_quantization_config(config: dict[str, Any], record: ConversionRecord) -> list[str]:
    """config.json's quantization_config, key for key, against the one quantize writes for the scheme and flags
    qconvert.json records (with the folder's own ignore list, which check_loader_view holds against the tensors
    the folder keeps float): an edit a loader acts on (`quantization_status`, a `format`, `output_activations`)
    fails, whatever the hashes say."""
    from qconvert.formats.kv_cache import KV_CACHE_SCHEME
    from qconvert.plan import FLOAT_WEIGHT_DTYPES
    from qconvert.schemes import scheme_named

    qconfig = config["quantization_config"]
    scheme = scheme_named(record.scheme)
    flags = record.flags
    group = flags.get("group_size")
    layout_flags = LayoutFlags(static_act=flags.get("act") == "static", double_quant=bool(flags.get("double_quant")),
                               group_size=int(group) if scheme.takes_group_size and isinstance(group, int) else None)
    ignore = qconfig.get("ignore", qconfig.get("llm_int8_skip_modules"))
    ignore = tuple(i for i in ignore if isinstance(i, str)) if isinstance(ignore, list) else ()
    declared = config.get("torch_dtype") or config.get("dtype")
    compute = declared if declared in FLOAT_WEIGHT_DTYPES else qconfig.get("bnb_4bit_compute_dtype", "float32")
    expected = scheme.layout.quantization_config(layout_flags, ignore, str(compute))
    if record.kv_cache is not None:  # written with --kv-cache: compressed-tensors' scheme of its scales
        expected = {**expected, "kv_cache_scheme": dict(KV_CACHE_SCHEME)}
    found = _first_difference(expected, qconfig, "quantization_config")
    if found is None:
        return []
    path, ours, theirs = found
    ours = "absent" if ours is _ABSENT else repr(ours)
    theirs = "absent" if theirs is _ABSENT else repr(theirs)
    return [f"config.json: {path} is {theirs}, but qconvert writes {ours} for scheme {record.scheme!r} with the flags "
            "qconvert.json records; a loader would read the folder otherwise"]


# What quantize adds to the source's config.json, and bookkeeping no forward reads.
CONFIG_KEYS_NOT_COMPARED = ("quantization_config", "_name_or_path", "transformers_version")
_ABSENT = object()


def _first_difference(ours: Any, theirs: Any, path: str) -> tuple[str, Any, Any] | None:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=str):
            found = _first_difference(ours.get(key, _ABSENT), theirs.get(key, _ABSENT), f"{path}.{key}")
            if found is not None:
                return found
        return None
    # JSON has one number type: 1 and 1.0 are the same value, but true is not 1.
    same = ours == theirs and type(ours) is type(theirs) or (
        isinstance(ours, (int, float)) and isinstance(theirs, (int, float))
        and not isinstance(ours, bool) and not isinstance(theirs, bool) and ours == theirs)
    return None if same else (path, ours, theirs)


def check_config_matches_reference(config: dict[str, Any], reference_config: dict[str, Any]) -> list[str]:
    """The folder's config.json against the reference's, field by field (nested keys named with dots).

    quantize copies the source's config and adds quantization_config; any other
    field that differs (rope_theta, hidden_act, rms_norm_eps, sliding_window, ...)
    would make the folder's forward differ from the one verify checks.
    """
    for key in sorted(set(config) | set(reference_config)):
        if key in CONFIG_KEYS_NOT_COMPARED:
            continue
        found = _first_difference(config.get(key, _ABSENT), reference_config.get(key, _ABSENT), key)
        if found is not None:
            path, ours, theirs = found
            ours = "absent" if ours is _ABSENT else repr(ours)
            theirs = "absent" if theirs is _ABSENT else repr(theirs)
            return [f"config.json: {path} is {ours}, but the reference's config.json has {theirs}; the folder "
                    "would not run the model it was converted from"]
    return []


def check_loader_view(quantized: QuantizedCheckpoint) -> list[str]:
    """The folder as its loader reads it agrees with what qconvert wrote, from the names and headers alone.

    The loader quantizes every linear its quantization_config targets and does not ignore (the layout's
    `loader_quantizes`, by the loader's own matching rule); so every quantized module must be one it
    replaces, and no linear kept float (nor the output head, stored or tied) one it would quantize.
    Routers, GPT-2-style Conv1Ds and, where the loader keeps experts float, experts may not be quantized.
    """
    layout, config = quantized.layout, quantized.config
    qconfig = config["quantization_config"]
    experts = expert_count(config)
    problems = list(filter(None, (_quantized_module_problem(quantized, module, experts)
                                  for module in quantized.quantized_modules)))
    floats = linear_candidates(quantized.checkpoint)
    head = head_name(config)
    if head not in quantized.quantized_modules and head not in floats:
        floats.append(head)  # tied or absent: the loader builds it all the same
    for module in floats:
        if is_conv1d(module) and not layout.loader_replaces_conv1d:
            continue
        if layout.loader_quantizes(qconfig, module):
            problems.append(f"{module}: kept float, but the loader would quantize it: the quantization_config's "
                            "ignore list does not name it")
    return problems


def _quantized_module_problem(quantized: QuantizedCheckpoint, module: str, experts: int | None) -> str | None:
    layout = quantized.layout
    if is_router(module, _out_features(quantized, module), experts):
        return (f"{module}: a router, quantized; loaders build routers unquantized and would not read it "
                "(the model would route with random weights)")
    if is_conv1d(module):
        return (f"{module}: a GPT-2-style Conv1D weight ([in, out]) written as a linear [out, in]; the loader "
                "would read it transposed, or not at all")
    if is_expert(module) and layout.loader_keeps_experts_float:
        return (f"{module}: an expert, quantized; transformers fuses the experts and its {layout.quant_method} "
                "path keeps them float, so it would not read it")
    if not layout.loader_quantizes(quantized.config["quantization_config"], module):
        return (f"{module}: quantized, but the quantization_config's ignore list names it, so the loader would "
                "not replace it and would find no float weight")
    return None


def _out_features(quantized: QuantizedCheckpoint, module: str) -> int | None:
    """A quantized linear's output width: its weight_scale's rows (header only), else its QArray's shape;
    None when its tensors cannot be read (the tensor checks that follow name what is wrong)."""
    scale = f"{module}.weight_scale"
    if scale in quantized:
        return quantized.checkpoint.shape(scale)[0]
    try:
        return quantized.qarray(module).shape[0]
    except FormatError:
        return None
