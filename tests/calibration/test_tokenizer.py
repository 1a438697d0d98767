"""A calibration file is read and tokenized only as far as the windows need, and the windows are those of the
whole file: the same tokens as the tokenizer gives the whole text, for word-level, WordPiece, byte-level BPE
and Llama-style (prepended, no pre-tokenizer) tokenizers."""

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint, make_tokenizer, minilm_path
from cli_helpers import PEAK_RSS_BYTES

from qconvert.calibration.data import load_calibration

QCONVERT = str(Path(sys.executable).parent / "qconvert")
PROSE = resources.files("qconvert").joinpath("data/calibration.txt").read_text(encoding="utf-8")


def trained_bpe(folder: Path, llama_style: bool) -> Path:
    """A BPE tokenizer.json trained on the built-in prose: byte-level (GPT-2's way), or Llama's (spaces
    turned into '▁', one '▁' prepended, no pre-tokenizer: the model sees the whole text as one piece)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if llama_style:
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.decoder = decoders.Metaspace()
    else:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if not llama_style else [])
    tokenizer.train_from_iterator([PROSE], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def whole_file_windows(folder: Path, text: str, samples: int, seqlen: int) -> np.ndarray:
    """The reference: the whole text tokenized at once, the tokenizer's specials around each window."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    bare = tokenizer.encode("calibration", add_special_tokens=False).ids
    full = tokenizer.encode("calibration", add_special_tokens=True).ids
    start = next(s for s in range(len(full)) if full[s:s + len(bare)] == bare)
    prefix, suffix = full[:start], full[start + len(bare):]
    body = seqlen - len(prefix) - len(suffix)
    stream = tokenizer.encode(text, add_special_tokens=False).ids
    return np.asarray([prefix + stream[k * body:(k + 1) * body] + suffix for k in range(samples)], np.int32)


TOKENIZERS = {
    "word-level": lambda root: make_tokenizer(root / "word", vocab_size=256),
    "wordpiece": lambda root: minilm_path(),
    "byte-level-bpe": lambda root: trained_bpe(root / "bytes", llama_style=False),
    "llama-style-bpe": lambda root: trained_bpe(root / "llama", llama_style=True),
}


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@pytest.mark.parametrize("samples,seqlen", [(4, 16), (3, 200)])
def test_the_windows_of_a_long_file_are_those_of_the_whole_text(tmp_path, kind, samples, seqlen):
    folder = TOKENIZERS[kind](tmp_path)
    text = (PROSE + "\n\n") * 40  # about 900 kB: many times what the windows need
    path = tmp_path / "calib.txt"
    path.write_text(text, encoding="utf-8")
    data = load_calibration(str(path), folder, {"max_position_embeddings": 4096}, samples=samples, seqlen=seqlen)
    np.testing.assert_array_equal(data.input_ids, whole_file_windows(folder, text, samples, seqlen))


def test_a_jsonl_is_read_only_as_far_as_the_windows_need(tmp_path):
    folder = make_tokenizer(tmp_path / "tok", vocab_size=256)
    path = tmp_path / "calib.jsonl"
    # Documents are encoded a batch at a time: a bad line far past the batches the windows need is never read.
    lines = [json.dumps({"text": PROSE[:2000]})] * 300 + ["this line is not JSON and is never read"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = load_calibration(str(path), folder, {}, samples=2, seqlen=16)
    assert data.input_ids.shape == (2, 16)


def peak_rss_mb(args, tmp_path) -> float:
    """Peak resident memory (MB) of one `qconvert` run, from the child's own rusage."""
    code = ("import sys; from qconvert.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            f"print({PEAK_RSS_BYTES})")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1]) / 2**20


def test_a_large_calibration_text_costs_no_more_memory_than_random_ids(tmp_path):
    # Tokenized whole, a 24 MB text took gigabytes; read as far as 4 windows need, it costs next to nothing.
    model = make_llama_checkpoint(tmp_path / "model")
    make_tokenizer(model, vocab_size=256)
    big = tmp_path / "big.txt"
    with open(big, "w", encoding="utf-8") as f:
        for _ in range(1100):
            f.write(PROSE + "\n")
    calib = ["--calib-samples", "4", "--calib-seqlen", "16"]
    text = peak_rss_mb(["calibrate", str(model), "-o", str(tmp_path / "a.safetensors"), "--calib", str(big),
                        "-q", *calib], tmp_path)
    ids = peak_rss_mb(["calibrate", str(model), "-o", str(tmp_path / "b.safetensors"), "--calib", "random",
                       "-q", *calib], tmp_path)
    assert text < ids + 150, (text, ids)
