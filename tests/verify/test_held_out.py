"""verify grades a folder on text its calibration did not read: the records say which text each used, and
the evaluation windows, rebuilt here independently, share no token run with the calibration windows."""

import json

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer
from cli_helpers import run

from qconvert.cli.main import main

VOCAB = 256
TINY = {"hidden": 64, "layers": 1, "heads": 4, "kv_heads": 2, "intermediate": 64, "vocab": VOCAB}
CALIB_SAMPLES, CALIB_SEQLEN = 4, 32


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("src") / "llama", **TINY)
    make_tokenizer(folder, vocab_size=VOCAB)
    return folder


def quantize(source, out, calib, *extra):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(source), "-o", str(out), "--scheme", "w8a8", "--quiet", "--calib", calib,
              "--calib-samples", str(CALIB_SAMPLES), "--calib-seqlen", str(CALIB_SEQLEN), *extra])
    assert exc.value.code == 0
    return json.loads((out / "qconvert.json").read_text())["calibration"]


def verify(folder, capsys, *extra):
    code, out, err = run(["verify", str(folder), "--quick", "--backend", "cpu", "--json", "-", *extra], capsys)
    return code, (json.loads(out) if out.strip() else None), err


def word_windows(source, text, samples, seqlen):
    """Windows of the tokenized text cut by hand: <s> then seqlen - 1 tokens of the stream, from its start."""
    from tokenizers import Tokenizer

    stream = Tokenizer.from_file(str(source / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    body = seqlen - 1
    count = min(samples, len(stream) // body)
    return np.array([[1] + stream[k * body:(k + 1) * body] for k in range(count)])


def runs(windows, n=16):
    return {tuple(row[i:i + n]) for row in np.asarray(windows).tolist() for i in range(len(row) - n + 1)}


def test_builtin_calibration_is_held_out_from_evaluation(source, tmp_path, capsys):
    from importlib import resources

    calibration = quantize(source, tmp_path / "w8a8", "builtin")
    body = CALIB_SEQLEN - 1
    assert calibration["source"] == "builtin" and calibration["stream_tokens"] == [0, CALIB_SAMPLES * body]
    code, record, err = verify(tmp_path / "w8a8", capsys)
    assert code == 0, err
    evaluation = record["evaluation"]
    held_out = evaluation["held_out"]
    assert held_out["calibration"] == calibration and held_out["disjoint"] is True
    assert evaluation["source"] == "held-out" and evaluation["stream_tokens"][0] == 0
    # Independently: the two texts tokenized and cut by hand share no run of 16 tokens.
    corpus = resources.files("qconvert").joinpath("data/calibration.txt").read_text(encoding="utf-8")
    prose = resources.files("qconvert").joinpath("data/evaluation.txt").read_text(encoding="utf-8")
    calibrated = word_windows(source, corpus, CALIB_SAMPLES, CALIB_SEQLEN)
    evaluated = word_windows(source, prose, evaluation["samples"], evaluation["seqlen"])
    assert calibrated.shape == (CALIB_SAMPLES, CALIB_SEQLEN) and evaluated.size == evaluation["tokens"]
    assert not runs(calibrated) & runs(evaluated)
    text = run(["verify", str(tmp_path / "w8a8"), "--quick", "--backend", "cpu"], capsys)[1]
    assert "evaluation text: qconvert's built-in held-out English prose" in text
    assert "held out from calibration (qconvert's built-in English prose corpus)" in text


def test_random_calibration_is_held_out_by_another_seed(source, tmp_path, capsys):
    calibration = quantize(source, tmp_path / "w8a8", "random")
    assert calibration["random"] is True and calibration["seed"] == 0
    code, record, err = verify(tmp_path / "w8a8", capsys)
    assert code == 0, err
    evaluation = record["evaluation"]
    assert evaluation["source"] == "random" and evaluation["seed"] != calibration["seed"]
    assert evaluation["held_out"]["disjoint"] is True
    # Independently: numpy's generator with each recorded seed; no evaluation window is a calibration window,
    # and no run of 16 ids is shared.
    calibrated = np.random.default_rng(calibration["seed"]).integers(0, VOCAB, (CALIB_SAMPLES, CALIB_SEQLEN))
    evaluated = np.random.default_rng(evaluation["seed"]).integers(0, VOCAB, (evaluation["samples"],
                                                                               evaluation["seqlen"]))
    assert not {tuple(r) for r in calibrated.tolist()} & {tuple(r) for r in evaluated.tolist()}
    assert not runs(calibrated) & runs(evaluated)


def test_evaluating_on_the_calibration_text_is_refused(source, tmp_path, capsys):
    quantize(source, tmp_path / "w8a8", "builtin")
    code, record, err = verify(tmp_path / "w8a8", capsys, "--calib", "builtin")
    assert code == 2 and record["exit_code"] == 2  # the refusal comes as a JSON error record too
    assert record["error"].startswith("the evaluation text (qconvert's built-in English prose corpus) shares ")
    assert err.strip().splitlines()[-1].startswith("qconvert: error: the evaluation text (qconvert's built-in English prose "
                                                   "corpus) shares ")
    assert "runs of 16 tokens with the calibration text" in err


def test_a_folder_without_a_calibration_record_verifies_with_a_note(source, tmp_path, capsys):
    quantize(source, tmp_path / "w8a8", "random")
    manifest = json.loads((tmp_path / "w8a8" / "qconvert.json").read_text())
    del manifest["calibration"]
    (tmp_path / "w8a8" / "qconvert.json").write_text(json.dumps(manifest))
    code, record, err = verify(tmp_path / "w8a8", capsys)
    assert code == 0, err
    held_out = record["evaluation"]["held_out"]
    assert held_out["calibration"] is None and held_out["disjoint"] is None
    assert held_out["note"].startswith("qconvert.json records no calibration text")
