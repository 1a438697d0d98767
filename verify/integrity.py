"""Integrity of a converted folder: file hashes against qconvert.json, config against the tensors.

Everything here reads bytes and headers only; no tensor math. Each problem is one
line that names the file (and tensor) at fault, so a CI log says what to look at.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from qconvert.errors import InvalidCheckpointError

RECORD_NAME = "qconvert.json"
_HASH_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class ConversionRecord:
    """The parts of qconvert.json that verify relies on."""

    raw: dict[str, Any]
    scheme: str
    files: dict[str, str]
    source_model: str | None
    source_revision: str | None


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


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_record(folder: Path) -> ConversionRecord:
    """Parse folder/qconvert.json; InvalidCheckpointError when it is missing or malformed."""
    path = Path(folder) / RECORD_NAME
    if not Path(folder).is_dir():
        raise InvalidCheckpointError(f"{folder}: not a folder; give the output folder of `qconvert quantize`")
    if not path.is_file():
        raise InvalidCheckpointError(
            f"{path}: missing; verify takes a folder written by `qconvert quantize`"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpointError(f"{path}: not valid JSON ({exc})") from exc
    files = raw.get("files") if isinstance(raw, dict) else None
    scheme = raw.get("scheme") if isinstance(raw, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise InvalidCheckpointError(f"{path}: no \"files\" map of sha256 hashes; re-run `qconvert quantize`")
    if not isinstance(scheme, str):
        raise InvalidCheckpointError(f"{path}: no \"scheme\"; re-run `qconvert quantize`")
    source = raw.get("source") if isinstance(raw.get("source"), dict) else {}
    revision = source.get("commit") or source.get("revision")
    return ConversionRecord(raw=raw, scheme=scheme, files=dict(files),
                            source_model=source.get("model"), source_revision=revision)


def check_files(folder: Path, record: ConversionRecord) -> list[str]:
    """Every recorded file exists with its recorded sha256; no unrecorded weight file lies beside them."""
    folder = Path(folder)
    problems = []
    for name in sorted(record.files):
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            problems.append(f"{RECORD_NAME}: lists {name!r}, a path outside the folder")
        elif not path.is_file():
            problems.append(f"{name}: missing (qconvert.json records it)")
        else:
            found = sha256_of(path)
            if found != record.files[name]:
                problems.append(
                    f"{name}: sha256 mismatch (recorded {record.files[name][:12]}..., found "
                    f"{found[:12]}...); the file changed after conversion"
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
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise InvalidCheckpointError(f"{path}: missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise InvalidCheckpointError(f"{path}: not a JSON object")
    return config


def scheme_of_quantization_config(qconfig: dict[str, Any]) -> str | None:
    """The qconvert scheme a quantization_config describes, or None when it fits none."""
    method = qconfig.get("quant_method")
    if method == "bitsandbytes":
        return "nf4" if qconfig.get("load_in_4bit") and qconfig.get("bnb_4bit_quant_type") == "nf4" else None
    if method != "compressed-tensors":
        return None
    groups = qconfig.get("config_groups") or {}
    group = next(iter(groups.values()), None) if isinstance(groups, dict) else None
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        return None
    if group["weights"].get("num_bits") != 8:
        return None
    fmt, acts = qconfig.get("format"), group.get("input_activations")
    if fmt == "pack-quantized" and acts is None:
        return "int8"
    if fmt == "int-quantized" and isinstance(acts, dict) and acts.get("num_bits") == 8:
        return "w8a8"
    return None


def check_config(config: dict[str, Any], record: ConversionRecord) -> list[str]:
    """config.json's quantization_config is present and describes the scheme qconvert.json records."""
    qconfig = config.get("quantization_config")
    if not isinstance(qconfig, dict):
        return ["config.json: no quantization_config; loaders would read the folder as a float model"]
    described = scheme_of_quantization_config(qconfig)
    if described != record.scheme:
        return [
            f"config.json: quantization_config describes {described or 'no known scheme'}, "
            f"but qconvert.json records scheme {record.scheme!r}"
        ]
    return []
