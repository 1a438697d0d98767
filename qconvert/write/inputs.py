"""The source files a conversion reads: which they are, their sha256 (hashed beside the work), and qconvert.json's
`source`, which names them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qconvert.formats.quantized_sources import SourceFormat
from qconvert.formats.record import SourceRecord
from qconvert.formats.safetensors_io import SafetensorsCheckpoint
from qconvert.formats.safetensors_writer import INDEX_NAME, sha256_file
from qconvert.source.hub import ResolvedModel
from qconvert.write.side_files import side_files


def input_files(folder: Path, ckpt: SafetensorsCheckpoint) -> list[str]:
    """The files of the source folder a conversion reads (relative paths)."""
    inputs = [p.relative_to(folder).as_posix() for p in ckpt.files] + ["config.json"] + side_files(folder)
    if (folder / INDEX_NAME).exists():
        inputs.append(INDEX_NAME)
    return inputs


def source_file_hashes(folder: Path, names: list[str]) -> dict[str, str]:
    """{relative path: sha256} of the input files a conversion read."""
    return {name: sha256_file(folder / name) for name in sorted(set(names))}


def hash_in_background(folder: Path, names: list[str]) -> Callable[[], dict[str, str]]:
    """Start hashing the input files on a second thread (hashlib releases the GIL); call the result to wait.

    The conversion is busy reading and quantizing meanwhile, so on two or more
    cores the input hashes cost little wall time.
    """
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["hashes"] = source_file_hashes(folder, names)
        except BaseException as err:  # handed to the caller on result()
            box["error"] = err

    thread = threading.Thread(target=work, name="qconvert-input-sha256", daemon=True)
    thread.start()

    def result() -> dict[str, str]:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["hashes"]

    return result


def source_record(resolved: ResolvedModel, out: Path, hashes: dict[str, str],
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
