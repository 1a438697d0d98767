"""Side files: the tokenizer, generation and sentence-transformers files that travel with the weights unchanged."""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from qconvert.formats.safetensors_writer import sha256_file

# What a side file is called, folder by folder (sentence-transformers' module configs one folder down).
SIDE_FILE_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "generation_config.json",
    "vocab.txt", "vocab.json", "merges.txt", "*.tiktoken", "spiece.model", "sentencepiece.bpe.model",
    "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "[0-9]_*/*.json",
)


def _inside_model(path: Path, folder: Path) -> bool:
    """A regular file inside the model folder, or a Hub cache snapshot's link to its own blobs/; a link that
    leads anywhere else (a tokenizer_config.json pointing at /etc/passwd) is not copied."""
    real, root = path.resolve(), folder.resolve()
    if root in real.parents:
        return True
    snapshots = folder.absolute().parent
    return snapshots.name == "snapshots" and (snapshots.parent / "blobs").resolve() in real.parents


def side_files(folder: Path) -> list[str]:
    """Relative paths (sorted) of the tokenizer/generation files in a model folder."""
    found = []
    depth = max(p.count("/") for p in SIDE_FILE_PATTERNS) + 1
    for path in sorted(_files_to_depth(folder, depth)):
        rel = path.relative_to(folder).as_posix()
        if any(side_file_match(rel, p) for p in SIDE_FILE_PATTERNS) and _inside_model(path, folder):
            found.append(rel)
    return found


def side_file_match(rel: str, pattern: str) -> bool:
    """Whether a relative path matches a side-file pattern folder by folder: each `/`-separated part of the
    pattern matches one part of the path (fnmatch's `*` alone crosses `/`: `tokenizer*` took
    `tokenizer_work/.git/config`), and no part of the path is hidden (`.git`, `.cache`)."""
    parts, wanted = rel.split("/"), pattern.split("/")
    return (len(parts) == len(wanted) and not any(part.startswith(".") for part in parts)
            and all(fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted)))


def _files_to_depth(folder: Path, depth: int) -> list[Path]:
    """The regular files of `folder` at most `depth` levels down (no deeper tree is walked)."""
    found, level = [], [folder]
    for _ in range(depth):
        below = []
        for directory in level:
            try:
                entries = list(directory.iterdir())
            except OSError:
                continue
            found += [e for e in entries if e.is_file()]
            below += [e for e in entries if e.is_dir() and not e.is_symlink() and not e.name.startswith(".")]
        level = below
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
