"""The output folder: staged beside OUT and renamed into place, side files copied, config and qconvert.json written."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qconvert.errors import OutputExistsError, OutputWriteError
from qconvert.formats.safetensors_io import sha256_file

MANIFEST_NAME = "qconvert.json"
# Tokenizer, generation and sentence-transformers files travel with the weights unchanged.
SIDE_FILE_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "generation_config.json",
    "vocab.txt", "vocab.json", "merges.txt", "*.tiktoken", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "[0-9]_*/*.json",
)


def check_output_free(out: Path, overwrite: bool) -> None:
    """Refuse an existing OUT unless overwriting; refuse to overwrite something that is not a folder."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{out} already exists; pass --overwrite to replace it, or choose another -o")
        if not out.is_dir() or out.is_symlink():
            raise OutputExistsError(f"{out} exists and is not a folder; remove it or choose another -o")


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder beside OUT; on success it becomes OUT, on any failure it is removed.

    A full disk, a failed write or Ctrl-C therefore never leaves a half-written OUT.
    """
    check_output_free(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as err:
        raise OutputWriteError(f"cannot create the output beside {out}: {err.strerror or err}") from None
    try:
        yield staging
        os.chmod(staging, 0o755)  # mkdtemp makes it private; OUT is an ordinary folder
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / "previous")
            os.replace(staging, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, out)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputWriteError(
            f"writing {out} failed: {err.strerror or err}; nothing was left behind, free space or fix "
            "permissions and run again"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def side_files(folder: Path) -> list[str]:
    """Relative paths (sorted) of the tokenizer/generation files in a model folder."""
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and any(fnmatch.fnmatchcase(rel, p) for p in SIDE_FILE_PATTERNS):
            found.append(rel)
    return found


def copy_side_files(source: Path, out: Path) -> dict[str, str]:
    """Copy the side files byte for byte; returns {relative path: sha256}."""
    hashes = {}
    for rel in side_files(source):
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, target)  # contents only: no timestamps or modes carried over
        os.chmod(target, 0o644)
        hashes[rel] = sha256_file(target)
    return hashes


def write_json(path: Path, data: Any) -> str:
    """Write JSON deterministically (2-space indent, newline at the end); returns its sha256."""
    raw = (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    path.write_bytes(raw)
    os.chmod(path, 0o644)
    return hashlib.sha256(raw).hexdigest()  # of the bytes just written, not read back


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
