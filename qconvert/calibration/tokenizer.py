"""Documents to token ids with the model's own tokenizer.json: calibration's windows, and padded batches.

Calibration concatenates the documents' tokens and cuts them into `samples` windows of `seqlen` tokens each (the
model's special tokens, such as BOS or [CLS]/[SEP], sit at each window's ends), so no sample needs padding and
every token counts in the statistics; only as much text is read and tokenized as the windows need. Evaluation
encodes sentences to a fixed length, padded on the right (TextTokenizer.encode).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer

from qconvert.calibration.chat import special_tokens
from qconvert.calibration.rows import read_text_prefix
from qconvert.formats.errors import InvalidCheckpointError, UsageError
from qconvert.formats.jsonfile import read_config

# Bytes of a .txt read at first: about CHARS_PER_TOKEN_READ characters a token asked for (more than any
# tokenizer's average), doubled while the text read gives too few tokens.
CHARS_PER_TOKEN_READ = 8
# Tokens past those asked for that a .txt prefix must give, so the tokens taken lie far from where it was cut.
PREFIX_MARGIN_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """Token ids and attention mask, both int32 [B, seq_len]; padding on the right."""

    input_ids: np.ndarray
    attention_mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A model's tokenizer and the id it pads with."""

    tokenizer: Tokenizer
    pad_id: int

    def untruncated(self) -> Tokenizer:
        """The tokenizer with no truncation or padding: some tokenizer.json files (all-MiniLM-L6-v2's) truncate
        to 128 tokens, while calibration's text is one long stream, cut into windows here."""
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        return self.tokenizer

    def token_ids(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids, untruncated and unpadded (for packing text into full-length chunks)."""
        encodings = self.untruncated().encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def encode(self, texts: Sequence[str], seq_len: int, add_special_tokens: bool = True) -> EncodedBatch:
        """Encode `texts` to exactly `seq_len` tokens each: longer ones truncated, shorter padded."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        self.tokenizer.enable_truncation(max_length=seq_len)
        self.tokenizer.enable_padding(direction="right", pad_id=self.pad_id, length=seq_len)
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        ids = np.array([e.ids for e in encodings], dtype=np.int32).reshape(len(encodings), seq_len)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int32).reshape(ids.shape)
        return EncodedBatch(ids, mask)


def load_tokenizer(folder) -> TextTokenizer:
    """The tokenizer.json of a model folder, or InvalidCheckpointError saying what is missing."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise InvalidCheckpointError(
            f"{folder} has no tokenizer.json; give a model folder with one, or use --calib random")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on malformed files
        raise InvalidCheckpointError(f"{path} cannot be read as a tokenizer ({exc})") from exc
    return TextTokenizer(tokenizer, _pad_id(tokenizer, folder))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise InvalidCheckpointError(f"{path} is not valid JSON ({exc}); fix or remove it") from exc


def _pad_id(tokenizer: Tokenizer, folder: Path) -> int:
    """The padding id: tokenizer.json's own padding, then tokenizer_config.json's pad_token,
    then config.json's pad_token_id, then its eos_token_id, else 0 (the mask hides it anyway)."""
    if tokenizer.padding is not None:
        return int(tokenizer.padding["pad_id"])
    pad_token = _read_json(folder / "tokenizer_config.json").get("pad_token")
    if isinstance(pad_token, dict):
        pad_token = pad_token.get("content")
    if isinstance(pad_token, str) and tokenizer.token_to_id(pad_token) is not None:
        return int(tokenizer.token_to_id(pad_token))
    config = read_config(folder, missing=None, broken="fix or remove it")
    for key in ("pad_token_id", "eos_token_id"):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0


def special_ends(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The tokens the model's post-processor puts around one text (BOS, or [CLS] ... [SEP]), found by encoding a
    probe with and without them: the ends of every window."""
    probe = "calibration"
    bare = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare):])
    return [], []


def window_bos(tokenizer: Tokenizer, model_folder: Path) -> str | None:
    """The BOS text that a chat template writes at a conversation's start and that every window already begins
    with (the tokenizer's post-processor puts it there): dropped from each rendered conversation, so that a window
    holds one BOS, at its start, as the model is served, never twice nor again mid-window."""
    prefix, _ = special_ends(tokenizer)
    bos = special_tokens(Path(model_folder)).get("bos_token")
    if prefix and bos and list(tokenizer.encode(bos, add_special_tokens=False).ids) == prefix:
        return bos
    return None


def token_windows(tokenizer: Tokenizer, texts: Iterable[str] | Path, samples: int, seqlen: int) -> np.ndarray:
    """Concatenated tokens of `texts` (documents, or a .txt file) cut into up to `samples` windows of `seqlen`
    (specials included). Only as much text is read and tokenized as the windows need."""
    prefix, suffix = special_ends(tokenizer)
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


def _stream(tokenizer: Tokenizer, texts: Iterable[str], needed: int, batch_size: int = 64) -> list[int]:
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


def _file_tokens(tokenizer: Tokenizer, path: Path, needed: int) -> list[int]:
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
