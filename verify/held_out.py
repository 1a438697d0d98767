"""Evaluation text held out from calibration: verify never grades a folder on the text it was calibrated on.

A w8a8 folder's activation scales (and its smoothing) were fitted on its
calibration windows, so figures measured on those same windows flatter it.
verify therefore evaluates on text calibration did not read: random ids from
another seed after random calibration, otherwise qconvert's held-out prose
(data/evaluation.txt). Disjointness is checked, not assumed: the calibration
windows are rebuilt from qconvert.json's record and no run of NGRAM tokens of
the evaluation windows may occur in them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qconvert.calibration.data import (DEFAULT_SAMPLES, DEFAULT_SEQLEN, FILE_FROM_OUT, RANDOM_SEED, CalibrationData,
                                       load_calibration, recorded_path)
from qconvert.calibration.documents import HELD_OUT, RANDOM, is_local_file
from qconvert.calibration.hub_dataset import recorded_selection
from qconvert.formats.errors import QConvertError, UsageError

AUTO = "auto"
# Tokens in a row that evaluation and calibration text may not share.
NGRAM = 16


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The evaluation windows and what they are held out from."""

    data: CalibrationData
    calibration: Mapping[str, Any] | None  # qconvert.json's calibration record; None when it has none
    disjoint: bool | None  # None: not checked (the note says why)
    note: str

    def record(self) -> dict[str, Any]:
        """verify's JSON `held_out` entry."""
        return {"calibration": dict(self.calibration) if self.calibration else None,
                "evaluation": self.data.description, "disjoint": self.disjoint, "ngram": NGRAM,
                "note": self.note}

    def line(self) -> str:
        """The one line verify prints about it."""
        return f"evaluation text: {self.data.description}; {self.note}"


def evaluation_source(calib: str, calibration: Mapping[str, Any] | None, has_tokenizer: bool) -> tuple[str, int]:
    """(source, seed) of the evaluation windows: `--calib` when given, else text calibration did not read."""
    seed = int(calibration.get("seed", RANDOM_SEED)) + 1 if calibration and calibration.get("random") \
        else RANDOM_SEED + 1
    if calib != AUTO:
        return calib, seed
    if (calibration and calibration.get("random")) or not has_tokenizer:
        return RANDOM, seed
    return HELD_OUT, seed


def ngrams(ids: np.ndarray, n: int = NGRAM, unknown: int | None = None) -> set[bytes]:
    """Every run of n tokens in each window (a shorter window counts whole), as bytes; a run more than three
    quarters of which is the tokenizer's unknown id is left out (unknown stands for any word the tokenizer
    cannot read, so two such runs say nothing of the text: under a small vocabulary most words are unknown;
    the same text still shares its runs with fewer unknowns)."""
    def telling(run: np.ndarray) -> bool:
        return unknown is None or 4 * int(np.count_nonzero(run == unknown)) <= 3 * run.size

    grams: set[bytes] = set()
    for row in np.asarray(ids, dtype=np.int64):
        if row.size < n:
            if telling(row):
                grams.add(row.tobytes())
            continue
        runs = np.lib.stride_tricks.sliding_window_view(row, n)
        grams.update(run.tobytes() for run in runs if telling(run))
    return grams


def shared_ngrams(evaluation: np.ndarray, calibration: np.ndarray, n: int = NGRAM, unknown: int | None = None) -> int:
    """How many distinct n-token runs of the evaluation windows also occur in the calibration windows."""
    return len(ngrams(evaluation, n, unknown) & ngrams(calibration, n, unknown))


def unknown_id(folder: Path) -> int | None:
    """The id the folder's tokenizer gives what it cannot read, or None (no tokenizer, or one without)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - the library raises bare Exceptions; reading it failed earlier if at all
        return None
    token = getattr(tokenizer.model, "unk_token", None)
    return tokenizer.token_to_id(token) if token else None


def calibration_file(calibration: Mapping[str, Any], out: Path | None) -> str:
    """The local calibration file qconvert.json records, from the working folder: where it lies from OUT
    (FILE_FROM_OUT), else its name in the working folder (a record that keeps only its name: the file lay outside
    OUT's parent); UsageError, in one line, when neither is there. A record kept as --calib was typed (an older
    qconvert) is that path."""
    source, where = str(calibration["source"]), calibration.get(FILE_FROM_OUT)
    if not isinstance(where, str):
        if Path(source).is_file() or Path(source).name != source:
            return source
        raise UsageError(f"qconvert.json records the calibration file {source} by its name and sha256 only (it lay "
                         f"outside OUT's parent folder) and the working folder has no {source}: run verify from "
                         "the folder that holds it")
    for path in (recorded_path(where, out) if out is not None else None, source):
        if path is not None and Path(path).is_file():
            return path
    raise UsageError(f"the calibration file {source} is neither at {where} from OUT nor in the working folder: "
                     f"put it back, or run verify from the folder that holds it")


def calibration_windows(calibration: Mapping[str, Any], folder: Path, config: dict[str, Any],
                        out: Path | None = None) -> np.ndarray:
    """The calibration windows again, from the record in OUT's qconvert.json (QConvertError when they cannot be
    rebuilt)."""
    source = str(calibration["source"])
    if is_local_file(source):
        source = calibration_file(calibration, out)
    data = load_calibration(source, folder, config,
                            samples=int(calibration.get("requested_samples", DEFAULT_SAMPLES)),
                            seqlen=int(calibration.get("requested_seqlen", DEFAULT_SEQLEN)),
                            seed=int(calibration.get("seed", RANDOM_SEED)),
                            dataset=recorded_selection(calibration))  # a whole dataset: its recorded commit
    if calibration.get("sha256") and data.sha256 != calibration["sha256"]:
        raise UsageError(f"the calibration file {source} is not the one the conversion read (its sha256 differs)")
    if data.input_ids.shape != (int(calibration["samples"]), int(calibration["seqlen"])):
        raise UsageError(f"rebuilding the calibration text gives {list(data.input_ids.shape)} windows, "
                         f"qconvert.json records [{calibration['samples']}, {calibration['seqlen']}]")
    return data.input_ids


def held_out_evaluation(calib: str, calibration: Mapping[str, Any] | None, folder: Path, config: dict[str, Any],
                        samples: int, seqlen: int, out: Path | None = None) -> HeldOut:
    """The evaluation windows, checked disjoint from calibration's (recorded in OUT's qconvert.json); UsageError
    when they share text."""
    has_tokenizer = (Path(folder) / "tokenizer.json").is_file()
    source, seed = evaluation_source(calib, calibration, has_tokenizer)
    data = load_calibration(source, folder, config, samples=samples, seqlen=seqlen, seed=seed)
    if not calibration:
        return HeldOut(data, None, None, "qconvert.json records no calibration text (the folder was not "
                                         "calibrated, or was written by an older qconvert): nothing to hold out")
    if data.sha256 is not None and data.sha256 == calibration.get("sha256"):  # found or not, the same file
        raise UsageError(f"the evaluation text ({data.description}) is the calibration file "
                         f"{calibration.get('source')} (the same sha256); verify on held-out text: pass --calib "
                         "with text calibration did not read")
    try:
        calibrated = calibration_windows(calibration, folder, config, out)
    except QConvertError as exc:
        return HeldOut(data, calibration, None, f"calibration text {calibration.get('source')!r} cannot be "
                                                f"rebuilt ({exc}): disjointness not checked")
    shared = shared_ngrams(data.input_ids, calibrated, unknown=unknown_id(folder) if source != RANDOM else None)
    if shared:
        raise UsageError(f"the evaluation text ({data.description}) shares {shared} runs of {NGRAM} tokens with "
                         f"the calibration text ({calibration.get('description')}); verify on held-out text: "
                         "pass --calib with text calibration did not read")
    return HeldOut(data, calibration, True, f"held out from calibration ({calibration.get('description')}): "
                                            f"no run of {NGRAM} tokens in common")
