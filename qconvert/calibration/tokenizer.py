"""Text to fixed-length token ids with a model's own tokenizer.json (the `tokenizers` library)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats.jsonfile import read_config


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

    def token_ids(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids, untruncated and unpadded (for packing text into full-length chunks)."""
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
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
