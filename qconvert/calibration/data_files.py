"""Which files of a dataset repository make one split, by the `datasets` library's data-files conventions.

The README's YAML `configs:` block decides where it names `data_files` (per split, or one pattern for `train`);
otherwise the split is found in the paths: sharded `data/SPLIT-00000-of-00002.*` names, then folders named after
a split (`train/`, `data/test-x/`), then file names (`train.jsonl`, `wiki_valid_1.parquet`), else every data file
is `train`. Hidden paths, `__special__` folders and the repository's own metadata files are never data. Of the files
left, the most common data extension decides how they are read (parquet on a tie), as `datasets` infers its
builder. Everything here works on a list of repository paths: no I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import PurePosixPath
from typing import Any, Sequence

from qconvert.formats.errors import UsageError

DEFAULT_CONFIG = "default"
SPLIT_PATTERN_SHARDED = "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*"
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEPARATORS = "-._ 0-9"  # what may stand beside a split's keyword in a name
_IN_FOLDER_NAME = ("**/{keyword}/**", "**/{keyword}[{sep}]*/**", "**/*[{sep}]{keyword}/**",
                   "**/*[{sep}]{keyword}[{sep}]*/**")
_IN_FILE_NAME = ("**/{keyword}[{sep}]*", "**/*[{sep}]{keyword}[{sep}]*")
FILES_TO_IGNORE = frozenset({"README.md", "config.json", "dataset_info.json", "dataset_infos.json",
                             "dummy_data.zip", "dataset_dict.json"})
_SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")
_SHARD_NAME = re.compile(r"^(?P<split>.*)-[0-9]{5}-of-[0-9]{5}")

# How each data extension is read: the ones qconvert reads, then those `datasets` knows that it does not.
READERS = {".parquet": "parquet", ".geoparquet": "parquet", ".gpq": "parquet", ".json": "json", ".jsonl": "json",
           ".ndjson": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text"}
OTHER_DATA = frozenset({
    ".arrow", ".tar", ".zip", ".xml", ".h5", ".hdf5", ".eval", ".pdf", ".lance", ".nii", ".mds",
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp",
    ".wav", ".mp3", ".flac", ".ogg", ".opus", ".m4a", ".mp4", ".avi", ".mov", ".mkv", ".webm"})


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    """The files of one split of one config, in the order they are read, and how to read them."""

    config: str
    split: str
    files: tuple[str, ...]  # repository paths
    reader: str  # a value of READERS


def glob_regex(pattern: str) -> re.Pattern[str]:
    """An fsspec glob as a regex over '/'-separated paths: `*` and `?` stay within a name, `[...]` is a class, and
    `**` as a whole name is any number of folders (none included); elsewhere `**` is `*`."""
    names = pattern.strip("/").split("/")
    out = []
    for k, name in enumerate(names):
        last = k == len(names) - 1
        if name == "**":
            out.append(".+" if last else "(?:[^/]+/)*")
            continue
        out.append(_name_regex(name) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")


def _name_regex(name: str) -> str:
    out, k = [], 0
    while k < len(name):
        char = name[k]
        if char == "*":
            while k + 1 < len(name) and name[k + 1] == "*":
                k += 1
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and (end := name.find("]", k + 2 if name[k + 1:k + 2] in ("!", "]") else k + 1)) > k:
            body = name[k + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("[" + body.replace("\\", "\\\\") + "]")
            k = end
        else:
            out.append(re.escape(char))
        k += 1
    return "".join(out)


def _has_magic(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def _parts_starting(path: str, prefix: str, parents_only: bool = False) -> int:
    pure = PurePosixPath(path)
    parts = pure.parent.parts if parents_only else pure.parts
    return sum(1 for part in parts if part.startswith(prefix) and set(part) != {"."})


def data_extension(path: str) -> str | None:
    """The first of a file name's suffixes that names a data format (`.jsonl` of `train.jsonl.gz`), or None."""
    for suffix in PurePosixPath(path).name.split(".")[1:]:
        if "." + suffix.lower() in READERS or "." + suffix.lower() in OTHER_DATA:
            return "." + suffix.lower()
    return None


def resolve(pattern: str, paths: Sequence[str]) -> list[str]:
    """The data files among `paths` that `pattern` matches, sorted: hidden files and folders and `__special__`
    folders only where the pattern names them, metadata files (README.md...) only where it names them."""
    regex = glob_regex(pattern)
    named = PurePosixPath(pattern).name
    found = []
    for path in paths:
        if not regex.match(path) or data_extension(path) is None:
            continue
        if PurePosixPath(path).name in FILES_TO_IGNORE and PurePosixPath(path).name != named:
            continue
        if _parts_starting(path, "__", parents_only=True) != _parts_starting(pattern, "__", parents_only=True):
            continue
        if _parts_starting(path, ".") != _parts_starting(pattern, "."):
            continue
        found.append(path)
    return sorted(found)


def inferred_patterns(paths: Sequence[str]) -> dict[str, list[str]]:
    """Each split's patterns found from the paths alone, as `datasets` finds them; {} when there are no data files."""
    sharded = resolve(SPLIT_PATTERN_SHARDED.replace("{split}", "*"), paths)
    if sharded:
        splits = {_SHARD_NAME.match(PurePosixPath(path).name)["split"] for path in sharded}
        bad = sorted(split for split in splits if not _SPLIT_NAME.match(split))
        if bad:
            raise UsageError(f"the dataset's shard names give split names {', '.join(map(repr, bad))}, which are not "
                             "split names (letters, digits, '_' and '.')")
        ordered = [s for s in SPLIT_KEYWORDS if s in splits] + sorted(splits - set(SPLIT_KEYWORDS))
        return {split: [SPLIT_PATTERN_SHARDED.format(split=split)] for split in ordered}
    for bases in (_IN_FOLDER_NAME, _IN_FILE_NAME):
        found = {split: [base.format(keyword=keyword, sep=_SEPARATORS) for keyword in keywords for base in bases]
                 for split, keywords in SPLIT_KEYWORDS.items()}
        found = {split: patterns for split, patterns in found.items()
                 if any(resolve(pattern, paths) for pattern in patterns)}
        if found:
            return found
    return {"train": ["**"]} if resolve("**", paths) else {}


def card_configs(metadata: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The README's `configs:` entries by name (UsageError for a block `datasets` would not read either)."""
    raw = (metadata or {}).get("configs")
    if raw is None:
        return {}
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        raise UsageError("the dataset's README.md has a `configs:` block that is not a list of mappings")
    configs: dict[str, dict[str, Any]] = {}
    for entry in raw:
        name = str(entry.get("config_name", DEFAULT_CONFIG))
        if name in configs:
            raise UsageError(f"the dataset's README.md names config {name!r} twice under `configs:`")
        configs[name] = entry
    return configs


def split_patterns(data_files: Any, config: str) -> dict[str, list[str]]:
    """A config's `data_files` as {split: patterns}: a pattern or a list of them is `train`; a list of
    {split, path} mappings (path a pattern or a list) names each split."""
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, dict):
        data_files = [{"split": split, "path": path} for split, path in data_files.items()]
    if isinstance(data_files, list) and all(isinstance(item, str) for item in data_files):
        return {"train": list(data_files)}
    if isinstance(data_files, list) and all(isinstance(item, dict) for item in data_files):
        out: dict[str, list[str]] = {}
        for item in data_files:
            path = item.get("path")
            paths = [path] if isinstance(path, str) else path
            if "split" not in item or not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise UsageError(f"the dataset's README.md config {config!r} has a data_files entry {item!r}; each "
                                 "must be {split: NAME, path: PATTERN or [PATTERNS]}")
            if str(item["split"]) in out:
                raise UsageError(f"the dataset's README.md config {config!r} names split {item['split']!r} twice")
            out[str(item["split"])] = paths
        return out
    raise UsageError(f"the dataset's README.md config {config!r} has data_files {data_files!r}; write a pattern, a "
                     "list of patterns, or a list of {split, path} entries")


def choose_config(configs: dict[str, dict[str, Any]], wanted: str | None, folders: Sequence[str]) -> tuple[str, dict]:
    """The config to read: `wanted`, else the default one (named 'default', marked `default: true`, or the only
    one). Without a `configs:` block `wanted` names a top folder (the Hub's parquet export lays configs out so)."""
    if not configs:
        if wanted in (None, DEFAULT_CONFIG):
            return DEFAULT_CONFIG, {}
        if wanted not in folders:
            raise UsageError(f"--calib-config {wanted}: the dataset's README.md names no configs, and it has no folder "
                             f"{wanted!r} (its top folders: {', '.join(folders) or 'none'})")
        return wanted, {"data_dir": wanted}
    if wanted is not None:
        if wanted not in configs:
            raise UsageError(f"--calib-config {wanted}: the dataset has no such config; its configs: "
                             f"{', '.join(configs)}")
        return wanted, configs[wanted]
    defaults = [name for name, entry in configs.items()
                if len(configs) == 1 or name == DEFAULT_CONFIG or entry.get("default") is True]
    if len(defaults) != 1:
        raise UsageError(f"the dataset has configs {', '.join(configs)} and "
                         f"{'several defaults' if defaults else 'no default'}; pass --calib-config NAME")
    return defaults[0], configs[defaults[0]]


def split_files(paths: Sequence[str], metadata: dict[str, Any] | None, split: str, config: str | None = None,
                where: str = "") -> SplitFiles:
    """The files of `split` (of `config`, or the default one) among the repository's `paths`, with the README's
    YAML `metadata`; UsageError naming the splits, configs or file types found when there is no such thing.
    `where` ends the messages (e.g. ' in the cached snapshot')."""
    name, entry = choose_config(card_configs(metadata), config, sorted({p.split("/")[0] for p in paths if "/" in p}))
    data_dir = entry.get("data_dir")
    if data_dir is not None and not isinstance(data_dir, str):
        raise UsageError(f"the dataset's README.md config {name!r} has data_dir {data_dir!r}, not a folder name")
    base = data_dir.strip("/") + "/" if data_dir else ""
    inside = [path[len(base):] for path in paths if path.startswith(base)]
    if entry.get("data_files") is not None:
        patterns = split_patterns(entry["data_files"], name)
    else:
        patterns = inferred_patterns(inside)
    if not patterns:
        raise UsageError(f"the dataset has no data files{where} (files: {_types(paths)}); qconvert reads .parquet, "
                         ".json, .jsonl, .csv, .tsv and .txt")
    if split not in patterns:
        raise UsageError(f"the dataset{'' if name == DEFAULT_CONFIG else f' config {name!r}'} has no split "
                         f"{split!r}{where}; its splits: {', '.join(patterns)} (pass one to --calib-split)")
    files: list[str] = []
    for pattern in patterns[split]:
        found = resolve(pattern, inside)
        if not found and not _has_magic(pattern):
            raise UsageError(f"the dataset's README.md names data file {base}{pattern} for split {split!r}, which "
                             f"the dataset does not have{where}")
        files += [path for path in found if path not in files]
    return _readable(SplitFiles(name, split, tuple(base + path for path in files), ""), where)


def _readable(found: SplitFiles, where: str) -> SplitFiles:
    """The split's files of its most common data extension (parquet on a tie), or UsageError naming the types."""
    counts = Counter("." + suffix.lower() for path in found.files for suffix in PurePosixPath(path).name.split(".")[1:])
    order = sorted(counts.items(), key=lambda item: (item[1], item[0] == ".parquet", item[0] == ".jsonl",
                                                     item[0] == ".json", item[0] == ".csv", item[0]), reverse=True)
    known = [ext for ext, _ in order if ext in READERS or ext in OTHER_DATA]
    if not known or known[0] not in READERS:
        raise UsageError(f"split {found.split!r} of the dataset has no file qconvert reads{where} (files: "
                         f"{_types(found.files)}); qconvert reads .parquet, .json, .jsonl, .csv, .tsv and .txt; "
                         "the Hub's parquet export of a dataset is at revision refs/convert/parquet "
                         "(hf://datasets/OWNER/NAME@refs%2Fconvert%2Fparquet)")
    reader = READERS[known[0]]
    extensions = tuple(ext for ext, name in READERS.items() if name == reader)
    files = tuple(path for path in found.files if data_extension(path) in extensions)
    return dataclasses.replace(found, files=files, reader=reader)


def _types(paths: Sequence[str]) -> str:
    counts = Counter(("".join(PurePosixPath(p).suffixes[-2:]) or PurePosixPath(p).name) for p in paths)
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items())) or "none"
