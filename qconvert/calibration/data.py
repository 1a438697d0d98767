"""Calibration data: the token windows of a `--calib` source (text, or random ids) and their record.

Text sources become documents (documents.py), which the model's own tokenizer.json cuts into windows
(tokenizer.py); random ids need no tokenizer. The record says what was read, for qconvert.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from qconvert.calibration.documents import BUILTIN, RANDOM, check_dataset_flags, is_local_file, open_documents
from qconvert.calibration.hub_dataset import DatasetSelection, is_whole_dataset
from qconvert.calibration.tokenizer import load_tokenizer, special_ends, token_windows, window_bos
from qconvert.formats.errors import InvalidCheckpointError, QConvertError, UsageError
from qconvert.formats.safetensors_io import sha256_file

DEFAULT_SAMPLES = 128
DEFAULT_SEQLEN = 512
RANDOM_SEED = 0


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
    dataset: dict[str, Any] | None = None  # a whole Hub dataset: what of it was read (documents.DatasetText.record)

    @property
    def samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seqlen(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.input_ids.size)

    def record(self, experts_split_over: int = 0) -> dict[str, Any]:
        """The calibration entry of qconvert.json; `experts_split_over`: the devices a MoE layer's experts were
        split over (--shard-experts), recorded where they were (the statistics then may round otherwise)."""
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
            **({"dataset": self.dataset} if self.dataset is not None else {}),
            **({"experts_split_over": experts_split_over} if experts_split_over else {}),
        }


# A local calibration file's record: where it lies from OUT (e.g. "../calib.txt"), where it lies in OUT's parent.
FILE_FROM_OUT = "file_from_out"


def placed_record(record: dict[str, Any] | None, out: Path) -> dict[str, Any] | None:
    """A calibration record as OUT keeps it (qconvert.json, or a statistics file OUT): a local file by its name
    and sha256, and, where it lies in OUT's parent folder, where it lies from OUT, so that verify finds it from
    any working folder; no path of this machine is kept. Built-in text, random ids and Hub text as they are.

    The record's `source` is a path from the working folder (as --calib gave it)."""
    if not record or not is_local_file(str(record.get("source", ""))):
        return record
    path, out = Path(os.path.abspath(str(record["source"]))), Path(os.path.abspath(out))
    placed = {k: v for k, v in record.items() if k != FILE_FROM_OUT}
    placed["source"] = path.name
    if _inside(path, out.parent) and path.is_file() and record.get("sha256") in (None, sha256_file(path)):
        placed[FILE_FROM_OUT] = Path(os.path.relpath(path, out)).as_posix()
    return placed


def located_record(record: dict[str, Any], out: Path) -> dict[str, Any]:
    """A record placed_record kept for OUT with its `source` a path from the working folder again, where it
    records one (FILE_FROM_OUT)."""
    where = record.get(FILE_FROM_OUT)
    if not isinstance(where, str):
        return record
    located = {k: v for k, v in record.items() if k != FILE_FROM_OUT}
    located["source"] = recorded_path(where, out)
    return located


def recorded_path(where: str, out: Path) -> str:
    """The path, from the working folder, of what lies at `where` from OUT."""
    return os.path.normpath(os.path.join(os.path.abspath(out), where))


def _inside(path: Path, folder: Path) -> bool:
    try:
        return os.path.commonpath([path, folder]) == str(folder)
    except ValueError:  # another drive
        return False


def random_windows(vocab_size: int, samples: int, seqlen: int, seed: int = RANDOM_SEED) -> np.ndarray:
    """Uniform random token ids int32 [samples, seqlen] from a fixed seed (reproducible)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(samples, seqlen), dtype=np.int64).astype(np.int32)


def _language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config values (a multimodal checkpoint's text_config), where its vocabulary and
    positions are."""
    from qconvert.models.registry import language_config  # here: the models import JAX, calibration text needs none

    return language_config(config)


def _vocab_size(language: dict[str, Any]) -> int:
    """The vocabulary --calib random draws from (InvalidCheckpointError, exit 6, for a missing or bad one)."""
    from qconvert.models.config_values import config_int

    return config_int(language, "vocab_size")


def load_calibration(calib: str, model_folder: Path, config: dict[str, Any], *,
                     samples: int = DEFAULT_SAMPLES, seqlen: int = DEFAULT_SEQLEN,
                     seed: int = RANDOM_SEED, dataset: DatasetSelection | None = None) -> CalibrationData:
    """Token windows for `--calib` (builtin | random | FILE.txt | FILE.jsonl | hf://datasets/... | held-out).

    `seed` seeds random ids; `dataset` picks the config, split and column of a whole Hub dataset.
    seqlen is capped at the model's max_position_embeddings; when the text runs
    out before `samples` full windows, fewer samples are taken and the record says so.
    """
    if samples < 1 or seqlen < 1:
        raise UsageError(f"--calib-samples and --calib-seqlen must be at least 1 "
                         f"(got {samples} and {seqlen})")
    check_dataset_flags(calib, dataset)
    language = _language_config(config)
    max_positions = language.get("max_position_embeddings")
    effective_seqlen = min(seqlen, int(max_positions)) if max_positions else seqlen
    if calib == RANDOM:
        return _random_calibration(_vocab_size(language), samples, seqlen, effective_seqlen, seed)
    tokenizer = _text_tokenizer(model_folder)  # before anything is read or downloaded
    bos = window_bos(tokenizer, model_folder) if is_whole_dataset(calib) else None
    documents = open_documents(calib, dataset or DatasetSelection(), model_folder, bos)
    with _encoding_errors(model_folder):
        ends = sum(len(end) for end in special_ends(tokenizer))
        if effective_seqlen < seqlen and effective_seqlen - ends < 1:  # the model's positions cap the windows
            raise InvalidCheckpointError(
                f"config.json's max_position_embeddings {max_positions} caps a window at {effective_seqlen} "
                f"token(s), which leaves no room besides the model's {ends} special token(s); fix "
                "max_position_embeddings")
        ids = token_windows(tokenizer, documents.texts, samples, effective_seqlen)
    _check_ids_in_vocabulary(ids, config, Path(model_folder) / "tokenizer.json")
    stream = ids.shape[0] * (ids.shape[1] - ends)
    _check_enough_text(tokenizer, ids, stream, min(MIN_TEXT_TOKENS, samples * (effective_seqlen - ends)), calib)
    return CalibrationData(ids, calib, documents.description, samples, seqlen, documents.sha256,
                           stream_tokens=stream, dataset=documents.record())


def _random_calibration(vocab: int, samples: int, seqlen: int, effective_seqlen: int, seed: int) -> CalibrationData:
    """--calib random: uniform ids over the vocabulary, `effective_seqlen` long (seqlen as asked, for the record)."""
    ids = random_windows(vocab, samples, effective_seqlen, seed)
    description = f"random token ids, uniform over the vocabulary of {vocab}, seed {seed}: not real text"
    return CalibrationData(ids, RANDOM, description, samples, seqlen, seed=seed)


def _text_tokenizer(model_folder: Path):
    """The model's tokenizer, untruncated, to cut calibration text into windows; UsageError when the folder has
    none (random ids need no tokenizer)."""
    if not (Path(model_folder) / "tokenizer.json").is_file():
        raise UsageError(f"{model_folder} has no tokenizer.json to tokenize calibration text; "
                         f"pass '--calib {RANDOM}' to calibrate on random token ids")
    return load_tokenizer(model_folder).untruncated()


@contextlib.contextmanager
def _encoding_errors(model_folder: Path):
    """The tokenizer's failures to encode as InvalidCheckpointError; the text's own errors (a bad row, a file not
    cached) as they are."""
    try:
        yield
    except QConvertError:
        raise
    except Exception as err:  # the tokenizers binding raises plain Exceptions from its Rust core
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise InvalidCheckpointError(f"{Path(model_folder) / 'tokenizer.json'} loads but cannot encode the "
                                     f"calibration text ({reason}); fix the tokenizer, or pass "
                                     f"'--calib {RANDOM}'") from None


# Fewer text tokens than this fit nothing (a static scale on 2 tokens ruins a folder): refused, not noted.
MIN_TEXT_TOKENS = 16


def _check_enough_text(tokenizer, ids: np.ndarray, stream: int, least: int, calib: str) -> None:
    """UsageError for text that runs out below `least` tokens (MIN_TEXT_TOKENS, or fewer where the windows asked
    for fewer), or holds no word (a BOM, NULs, punctuation)."""
    if stream < least:
        raise UsageError(f"--calib {calib} gives {max(stream, 0)} token(s) of text; calibrating needs at least "
                         f"{MIN_TEXT_TOKENS} (and far more to stand for the model's use): pass more text, or "
                         f"'--calib {BUILTIN}'")
    raw = getattr(tokenizer, "tokenizer", tokenizer)
    prefix, suffix = special_ends(tokenizer)  # the window's own specials (BOS, EOS) are not the text
    body = [int(i) for i in ids[0]][len(prefix):ids.shape[1] - len(suffix)]
    sample = raw.decode(body, skip_special_tokens=True)
    unknown = getattr(raw.model, "unk_token", None)  # what the tokenizer makes of what it cannot read
    if not any(ch.isalnum() for ch in (sample.replace(unknown, " ") if unknown else sample)):
        raise UsageError(f"--calib {calib} holds no word (its first window decodes to {sample[:40]!r}); pass "
                         f"a file of text, or '--calib {BUILTIN}'")


def _check_ids_in_vocabulary(ids: np.ndarray, config: dict[str, Any], tokenizer_path: Path) -> None:
    """Token ids the embedding has no row for are refused where they are made (the embedding's gather would
    fill NaN, and every statistic after it; transformers raises IndexError on them)."""
    vocab = _language_config(config).get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or ids.size == 0:
        return
    top = int(ids.max())
    if top >= vocab or int(ids.min()) < 0:
        bad = top if top >= vocab else int(ids.min())
        raise InvalidCheckpointError(
            f"{tokenizer_path} gives token id {bad} for this text, outside config.json's vocab_size {vocab} "
            "(the embedding has no row for it): the tokenizer and the model disagree; fix one of them, or pass "
            f"'--calib {RANDOM}'")
