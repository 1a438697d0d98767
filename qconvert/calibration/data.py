"""Calibration data: read text (a local file, a Hub dataset file, the built-in corpus) or draw random ids, and cut it into token windows.

Text is tokenized with the model's own tokenizer.json, concatenated, and cut
into `samples` windows of `seqlen` tokens each (the model's special tokens,
such as BOS or [CLS]/[SEP], sit at each window's ends), so no sample needs
padding and every token counts in the statistics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from qconvert.formats.errors import HubUnavailableError, InvalidCheckpointError, ModelNotFoundError, UsageError

BUILTIN = "builtin"
RANDOM = "random"
# verify's held-out prose: shipped beside the calibration corpus, never used to calibrate.
HELD_OUT = "held-out"
DEFAULT_SAMPLES = 128
DEFAULT_SEQLEN = 512
RANDOM_SEED = 0

_HF_DATASET = re.compile(r"^hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(@(?P<rev>[^/]+))?"
                         r"/(?P<path>.+)$")


@dataclasses.dataclass(frozen=True)
class CalibrationData:
    """Token windows for calibration and what they are, for qconvert.json."""

    input_ids: np.ndarray  # int32 [samples, seqlen]
    source: str  # "builtin", "random", a local path, or an hf://datasets/... address
    description: str
    requested_samples: int
    requested_seqlen: int
    sha256: str | None = None  # of the calibration file, for file sources
    seed: int | None = None  # of random ids
    stream_tokens: int | None = None  # text: the windows hold the text's first stream_tokens tokens

    @property
    def samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.input_ids.size)

    def record(self) -> dict[str, Any]:
        """The calibration entry of qconvert.json."""
        return {
            "source": self.source,
            "description": self.description,
            "random": self.source == RANDOM,
            "samples": self.samples,
            "seqlen": self.seqlen,
            "tokens": self.tokens,
            "requested_samples": self.requested_samples,
            "requested_seqlen": self.requested_seqlen,
            **({"sha256": self.sha256} if self.sha256 else {}),
            **({"seed": self.seed} if self.seed is not None else {}),
            **({"stream_tokens": [0, self.stream_tokens]} if self.stream_tokens is not None else {}),
        }


def builtin_corpus_text() -> str:
    """The English prose shipped inside the package: the offline default calibration text."""
    return resources.files("qconvert").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def held_out_text() -> str:
    """English prose shipped for evaluation only: text no calibration reads unless given it as a file."""
    return resources.files("qconvert").joinpath("data/evaluation.txt").read_text(encoding="utf-8")


def read_texts(path: Path) -> list[str]:
    """Documents of a local .txt (the whole file) or .jsonl (each line's "text" field)."""
    if not path.is_file():
        raise UsageError(f"calibration file {path} does not exist; pass a .txt or .jsonl file, "
                         f"'{BUILTIN}' or '{RANDOM}' to --calib")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise UsageError(f"calibration file {path} must end in .txt or .jsonl")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(f"calibration file {path} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r}); convert it to UTF-8") from None
    if suffix == ".txt":
        return [text]
    if suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{path} line {lineno} is not JSON ({err.msg}); "
                                 "each line must be an object with a \"text\" field") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise UsageError(f"{path} line {lineno} has no string \"text\" field; "
                                 "each line must be an object with a \"text\" field")
            texts.append(row["text"])
    return texts


def download_dataset_file(address: str) -> Path:
    """Fetch hf://datasets/<owner>/<name>[@revision]/<path> with huggingface_hub; the local path."""
    match = _HF_DATASET.match(address)
    if match is None or ".." in match["path"].split("/") or ".." in (match["rev"] or "").split("/"):
        raise UsageError(f"cannot read calibration address {address!r}; "
                         "write hf://datasets/<owner>/<name>[@revision]/<file.txt|file.jsonl>")
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    from qconvert.source.hub import hub_unreachable_reason

    # One short probe instead of huggingface_hub's retries: unreachable means the cache alone.
    cache_only = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() not in {"1", "ON", "YES", "TRUE"} \
        and hub_unreachable_reason() is not None
    try:
        local = huggingface_hub.hf_hub_download(
            repo_id=match["repo"], filename=match["path"], repo_type="dataset", revision=match["rev"],
            **({"local_files_only": True} if cache_only else {}))
    except (hub_errors.LocalEntryNotFoundError, OSError) as err:  # before EntryNotFoundError, its base
        raise HubUnavailableError(f"cannot download {address}: the Hub is unreachable and the file "
                                  f"is not cached ({type(err).__name__}); pass a local file or "
                                  f"'--calib {BUILTIN}'") from None
    except hub_errors.HFValidationError as err:
        raise UsageError(f"cannot read calibration address {address!r} ({err}); write "
                         "hf://datasets/<owner>/<name>[@revision]/<file.txt|file.jsonl>") from None
    except (hub_errors.RepositoryNotFoundError, hub_errors.EntryNotFoundError,
            hub_errors.RevisionNotFoundError) as err:
        raise ModelNotFoundError(f"calibration file {address} not found on the Hub "
                                 f"({type(err).__name__}); check the repository and path") from None
    return Path(local)


def _special_ends(tokenizer) -> tuple[list[int], list[int]]:
    # The tokens the model's post-processor puts around one text (BOS, or
    # [CLS] ... [SEP]), found by encoding a probe with and without them.
    probe = "calibration"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare):])
    return [], []


def load_tokenizer(model_folder: Path):
    """The model's tokenizer.json as a `tokenizers.Tokenizer` with no truncation or padding.

    UsageError when the folder has none (random ids need no tokenizer).
    """
    from qconvert.calibration import tokenizer as model_tokenizer

    path = Path(model_folder) / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"{model_folder} has no tokenizer.json to tokenize calibration text; "
                         f"pass '--calib {RANDOM}' to calibrate on random token ids")
    tokenizer = model_tokenizer.load_tokenizer(model_folder).tokenizer
    # Some tokenizer.json files (all-MiniLM-L6-v2's) truncate to 128 tokens; the
    # calibration text is one long stream, cut into windows here.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def token_windows(tokenizer, texts: list[str], samples: int, seqlen: int) -> np.ndarray:
    """Concatenated tokens of `texts` cut into up to `samples` windows of `seqlen` (specials included)."""
    prefix, suffix = _special_ends(tokenizer)
    body = seqlen - len(prefix) - len(suffix)
    if body < 1:
        raise UsageError(f"--calib-seqlen {seqlen} leaves no room besides the model's "
                         f"{len(prefix) + len(suffix)} special tokens; pass a larger one")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch([t for t in texts if t.strip()], add_special_tokens=False):
        stream.extend(encoding.ids)
        if len(stream) >= samples * body:
            break
    if not stream:
        raise UsageError("the calibration text is empty; pass a file with text in it")
    count = max(1, min(samples, len(stream) // body))
    if len(stream) < body:
        body = len(stream)  # a text shorter than one window gives one shorter window
    windows = [prefix + stream[k * body:(k + 1) * body] + suffix for k in range(count)]
    return np.asarray(windows, dtype=np.int32)


def random_windows(vocab_size: int, samples: int, seqlen: int, seed: int = RANDOM_SEED) -> np.ndarray:
    """Uniform random token ids int32 [samples, seqlen] from a fixed seed (reproducible)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(samples, seqlen), dtype=np.int64).astype(np.int32)


def _calibration_texts(calib: str) -> tuple[list[str], str, str | None]:
    """The texts of a text --calib, what they are, and the sha256 of the file they came from (None: built in)."""
    if calib == BUILTIN:
        return [builtin_corpus_text()], "qconvert's built-in English prose corpus", None
    if calib == HELD_OUT:
        return [held_out_text()], "qconvert's built-in held-out English prose (never calibrated on)", None
    local = download_dataset_file(calib) if calib.startswith("hf://") else Path(calib)
    texts = read_texts(local)
    description = f"Hub dataset file {calib}" if calib.startswith("hf://") else f"local file {local.name}"
    return texts, description, hashlib.sha256(local.read_bytes()).hexdigest()


def load_calibration(calib: str, model_folder: Path, config: dict[str, Any], *,
                     samples: int = DEFAULT_SAMPLES, seqlen: int = DEFAULT_SEQLEN,
                     seed: int = RANDOM_SEED) -> CalibrationData:
    """Token windows for `--calib` (builtin | random | FILE.txt | FILE.jsonl | hf://datasets/... | held-out).

    `seed` seeds random ids.
    seqlen is capped at the model's max_position_embeddings; when the text runs
    out before `samples` full windows, fewer samples are taken and the record says so.
    """
    if samples < 1 or seqlen < 1:
        raise UsageError(f"--calib-samples and --calib-seqlen must be at least 1 "
                         f"(got {samples} and {seqlen})")
    max_positions = config.get("max_position_embeddings")
    effective_seqlen = min(seqlen, int(max_positions)) if max_positions else seqlen
    if calib == RANDOM:
        vocab = int(config["vocab_size"])
        ids = random_windows(vocab, samples, effective_seqlen, seed)
        description = (f"random token ids, uniform over the vocabulary of {vocab}, seed {seed}: "
                       "not real text")
        return CalibrationData(ids, RANDOM, description, samples, seqlen, seed=seed)
    texts, description, digest = _calibration_texts(calib)
    tokenizer = load_tokenizer(model_folder)
    try:
        ids = token_windows(tokenizer, texts, samples, effective_seqlen)
        stream = ids.shape[0] * (ids.shape[1] - sum(len(end) for end in _special_ends(tokenizer)))
    except UsageError:
        raise
    except Exception as err:  # the tokenizers binding raises plain Exceptions from its Rust core
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise InvalidCheckpointError(f"{Path(model_folder) / 'tokenizer.json'} loads but cannot encode the "
                                     f"calibration text ({reason}); fix the tokenizer, or pass "
                                     f"'--calib {RANDOM}'") from None
    return CalibrationData(ids, calib, description, samples, seqlen, digest, stream_tokens=stream)
