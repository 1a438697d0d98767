"""Calibration data: text (a local file, a Hub dataset or one of its files, the built-in corpus) or random ids, cut into token windows.

Text is tokenized with the model's own tokenizer.json, concatenated, and cut
into `samples` windows of `seqlen` tokens each (the model's special tokens,
such as BOS or [CLS]/[SEP], sit at each window's ends), so no sample needs
padding and every token counts in the statistics.
"""

from __future__ import annotations

import codecs
import dataclasses
import itertools
import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from qconvert.calibration.hub_dataset import DatasetSelection, download_dataset_file, is_whole_dataset
from qconvert.formats.errors import InvalidCheckpointError, QConvertError, UsageError
from qconvert.formats.safetensors_io import sha256_file

BUILTIN = "builtin"
RANDOM = "random"
# verify's held-out prose: shipped beside the calibration corpus, never used to calibrate.
HELD_OUT = "held-out"
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
    dataset: dict[str, Any] | None = None  # a whole Hub dataset: what of it was read (rows.DatasetText.record)

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


def builtin_corpus_text() -> str:
    """The English prose shipped inside the package: the offline default calibration text."""
    return resources.files("qconvert").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def held_out_text() -> str:
    """English prose shipped for evaluation only: text no calibration reads unless given it as a file."""
    return resources.files("qconvert").joinpath("data/evaluation.txt").read_text(encoding="utf-8")


# Bytes of a .txt read at first: about CHARS_PER_TOKEN_READ characters a token asked for (more than any
# tokenizer's average), doubled while the text read gives too few tokens.
CHARS_PER_TOKEN_READ = 8
# Tokens past those asked for that a .txt prefix must give, so the tokens taken lie far from where it was cut.
PREFIX_MARGIN_TOKENS = 64
READ_CHUNK_BYTES = 1 << 20


def check_text_file(path: Path) -> None:
    """UsageError unless `path` is a .txt or .jsonl file."""
    if not path.is_file():
        raise UsageError(f"calibration file {path} does not exist; pass a .txt or .jsonl file, "
                         f"'{BUILTIN}' or '{RANDOM}' to --calib")
    if path.suffix.lower() not in (".txt", ".jsonl"):
        raise UsageError(f"calibration file {path} must end in .txt or .jsonl")


def _decoded(path: Path, data: bytes, offset: int, decoder, final: bool) -> str:
    """`data` (the bytes at `offset` of the file) decoded; UsageError naming the first byte that is not UTF-8."""
    pending = len(decoder.getstate()[0])
    try:
        return decoder.decode(data, final=final)
    except UnicodeDecodeError as err:
        start = offset - pending + err.start
        raise UsageError(f"calibration file {path} is not UTF-8 text (byte {start}: "
                         f"{err.object[err.start:err.start + 1]!r}); convert it to UTF-8") from None


def read_text_prefix(path: Path, chars: int) -> tuple[str, bool]:
    """The first `chars` characters of a UTF-8 file (or all of it), and whether that is all of it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts, have, offset = [], 0, 0
    with open(path, "rb") as f:
        while have <= chars:
            data = f.read(READ_CHUNK_BYTES)
            text = _decoded(path, data, offset, decoder, final=not data)
            offset += len(data)
            parts.append(text)
            have += len(text)
            if not data:
                return "".join(parts), True
    text = "".join(parts)
    return text[:chars], False


def iter_jsonl_texts(path: Path) -> Iterator[str]:
    """Each line's "text" field of a .jsonl file, read a line at a time."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decoded(path, raw, offset, codecs.getincrementaldecoder("utf-8")(), final=True)
            offset += len(raw)
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
            yield row["text"]


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


def token_windows(tokenizer, texts: Iterable[str] | Path, samples: int, seqlen: int) -> np.ndarray:
    """Concatenated tokens of `texts` (documents, or a .txt file) cut into up to `samples` windows of `seqlen`
    (specials included). Only as much text is read and tokenized as the windows need."""
    prefix, suffix = _special_ends(tokenizer)
    body = seqlen - len(prefix) - len(suffix)
    if body < 1:
        raise UsageError(f"--calib-seqlen {seqlen} leaves no room besides the model's "
                         f"{len(prefix) + len(suffix)} special tokens; pass a larger one")
    needed = samples * body
    stream = _file_tokens(tokenizer, texts, needed) if isinstance(texts, Path) else _stream(tokenizer, texts, needed)
    if not stream:
        raise UsageError("the calibration text is empty; pass a file with text in it")
    count = max(1, min(samples, len(stream) // body))
    if len(stream) < body:
        body = len(stream)  # a text shorter than one window gives one shorter window
    windows = [prefix + stream[k * body:(k + 1) * body] + suffix for k in range(count)]
    return np.asarray(windows, dtype=np.int32)


def _stream(tokenizer, texts: Iterable[str], needed: int, batch_size: int = 64) -> list[int]:
    """The documents' tokens concatenated, a batch of documents encoded at a time until `needed` are there: one
    document first, then as many as the tokens still needed take at the documents' average so far (at most
    `batch_size`), so that text read lazily (a dataset's files, fetched one by one) is read little past the
    windows' end."""
    stream: list[int] = []
    documents = (text for text in texts if text.strip())
    read, want = 0, 1
    while len(stream) < needed and (batch := list(itertools.islice(documents, want))):
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            stream.extend(encoding.ids)
            if len(stream) >= needed:
                break
        read += len(batch)
        per_document = max(1.0, len(stream) / read)
        want = min(batch_size, max(1, math.ceil((needed - len(stream)) / per_document)))
    return stream


def _file_tokens(tokenizer, path: Path, needed: int) -> list[int]:
    """At least `needed` tokens of a .txt file (all of them if it has fewer), the same as the whole file's first
    ones: its prefixes are tokenized, growing, each cut where a word ends, until one gives `needed` tokens and
    PREFIX_MARGIN_TOKENS more (a tokenizer joins nothing across a word's end, and the margin keeps the tokens
    taken clear of the cut)."""
    chars = max(needed, 1) * CHARS_PER_TOKEN_READ
    while True:
        text, whole = read_text_prefix(path, chars)
        if not whole:
            text = text[:_last_word_end(text)]
        ids = list(tokenizer.encode(text, add_special_tokens=False).ids) if text.strip() else []
        if whole or len(ids) >= needed + PREFIX_MARGIN_TOKENS:
            return ids
        chars *= 2


def _last_word_end(text: str) -> int:
    """Where the last run of whitespace in `text` begins (0 where there is none): the end of a whole word."""
    match = _LAST_SPACE_RUN.search(text)
    return match.start() if match else 0


_LAST_SPACE_RUN = re.compile(r"\s+(?=\S*\Z)")


def random_windows(vocab_size: int, samples: int, seqlen: int, seed: int = RANDOM_SEED) -> np.ndarray:
    """Uniform random token ids int32 [samples, seqlen] from a fixed seed (reproducible)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(samples, seqlen), dtype=np.int64).astype(np.int32)


def _calibration_texts(calib: str) -> tuple[Iterable[str] | Path, str, str | None]:
    """The documents of a text --calib (a .txt file as its path: read as far as needed), what they are, and the
    sha256 of the file they come from (None: built in)."""
    if calib == BUILTIN:
        return [builtin_corpus_text()], "qconvert's built-in English prose corpus", None
    if calib == HELD_OUT:
        return [held_out_text()], "qconvert's built-in held-out English prose (never calibrated on)", None
    local = download_dataset_file(calib) if calib.startswith("hf://") else Path(calib)
    check_text_file(local)
    texts = local if local.suffix.lower() == ".txt" else iter_jsonl_texts(local)
    description = f"Hub dataset file {calib}" if calib.startswith("hf://") else f"local file {local.name}"
    return texts, description, sha256_file(local)


def check_calibration_source(calib: str | None, dataset: DatasetSelection | None = None) -> None:
    """UsageError for a --calib that calibration may not read: verify's held-out text (calibrating on it would
    leave verify nothing held out, while qconvert.json said it was never calibrated on); or dataset flags
    without a whole dataset to apply to."""
    if calib == HELD_OUT:
        raise UsageError(f"--calib {HELD_OUT} is verify's evaluation text, kept out of calibration so that verify "
                         f"measures on text the conversion never saw; calibrate on '{BUILTIN}' (the default), a "
                         "file or a dataset")
    check_dataset_flags(calib, dataset)


def check_dataset_flags(calib: str | None, dataset: DatasetSelection | None) -> None:
    """UsageError for --calib-config/-split/-column given where --calib is not a whole Hub dataset."""
    given = dataset.given() if dataset is not None else []
    for field, flag in DatasetSelection.FLAGS:
        if flag in given and not str(getattr(dataset, field)).strip():
            raise UsageError(f"{flag} is empty; name the {field} to read")
    if given and not is_whole_dataset(calib):
        raise UsageError(f"{', '.join(given)} choose{'s' if len(given) == 1 else ''} from a whole Hub dataset "
                         f"(--calib hf://datasets/OWNER/NAME), not from --calib {calib or BUILTIN}")


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
        vocab = _vocab_size(language)
        ids = random_windows(vocab, samples, effective_seqlen, seed)
        description = (f"random token ids, uniform over the vocabulary of {vocab}, seed {seed}: "
                       "not real text")
        return CalibrationData(ids, RANDOM, description, samples, seqlen, seed=seed)
    whole = None  # a whole Hub dataset's text, which says what it read once it has been read
    if is_whole_dataset(calib):
        from qconvert.calibration.rows import open_dataset_text

        tokenizer = load_tokenizer(model_folder)  # before anything is downloaded
        texts = whole = open_dataset_text(calib, dataset or DatasetSelection(), model_folder,
                                          _window_bos(tokenizer, model_folder))
        digest = None
    else:
        texts, description, digest = _calibration_texts(calib)
        tokenizer = load_tokenizer(model_folder)
    if effective_seqlen < seqlen:  # the model's positions cap the windows: name that, not the flag
        ends = sum(len(end) for end in _special_ends(tokenizer))
        if effective_seqlen - ends < 1:
            raise InvalidCheckpointError(
                f"config.json's max_position_embeddings {max_positions} caps a window at {effective_seqlen} "
                f"token(s), which leaves no room besides the model's {ends} special token(s); fix "
                "max_position_embeddings")
    try:
        ids = token_windows(tokenizer, texts, samples, effective_seqlen)
        stream = ids.shape[0] * (ids.shape[1] - sum(len(end) for end in _special_ends(tokenizer)))
    except QConvertError:  # the text's own errors (a bad row, a file not cached) as they are
        raise
    except Exception as err:  # the tokenizers binding raises plain Exceptions from its Rust core
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise InvalidCheckpointError(f"{Path(model_folder) / 'tokenizer.json'} loads but cannot encode the "
                                     f"calibration text ({reason}); fix the tokenizer, or pass "
                                     f"'--calib {RANDOM}'") from None
    _check_ids_in_vocabulary(ids, config, Path(model_folder) / "tokenizer.json")
    requested = samples * (effective_seqlen - sum(len(end) for end in _special_ends(tokenizer)))
    _check_enough_text(tokenizer, ids, stream, min(MIN_TEXT_TOKENS, requested), calib)
    if whole is not None:
        description = whole.description
    return CalibrationData(ids, calib, description, samples, seqlen, digest, stream_tokens=stream,
                           dataset=whole.record() if whole is not None else None)


def _window_bos(tokenizer, model_folder: Path) -> str | None:
    """The BOS text that a chat template writes at a conversation's start and that every window already begins
    with (the tokenizer's post-processor puts it there): dropped from each rendered conversation, so that a window
    holds one BOS, at its start, as the model is served, never twice nor again mid-window."""
    from qconvert.calibration.chat import special_tokens

    prefix, _ = _special_ends(tokenizer)
    bos = special_tokens(Path(model_folder)).get("bos_token")
    if prefix and bos and list(tokenizer.encode(bos, add_special_tokens=False).ids) == prefix:
        return bos
    return None


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
    prefix, suffix = _special_ends(tokenizer)  # the window's own specials (BOS, EOS) are not the text
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
