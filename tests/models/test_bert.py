"""The BERT JAX forward matches transformers' BertModel (float32), tiny random and all-MiniLM-L6-v2."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoints import make_bert_checkpoint, make_tokenizer, minilm_path
from qconvert.models import BertModel, build, mean_pool
from qconvert.calibration.layers import forward_layerwise
from qconvert.calibration.tokenizer import load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SENTENCES = [
    "A man is eating food.",
    "Quantization keeps eight bits per weight and one scale per output channel.",
    "The cat sits outside",
    "Smoothing moves the outliers from activations into the weights, where they are easier to quantize.",
]


def _reference_hidden(folder, ids, mask) -> np.ndarray:
    model = transformers.BertModel.from_pretrained(str(folder), dtype=torch.float32,
                                                   add_pooling_layer=False)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.last_hidden_state.numpy()


def _params(folder):
    return load_file(str(folder / "model.safetensors"))


def test_tiny_bert_last_hidden_state_matches_transformers(tmp_path):
    folder = make_bert_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config["vocab_size"], size=(3, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    mask[2, 7:] = 0
    expected = _reference_hidden(folder, ids, mask)
    model = build(config)
    assert isinstance(model, BertModel)
    got = np.asarray(model.forward(_params(folder), ids, mask))
    valid = mask.astype(bool)
    # LayerNorm outputs are O(1); measured diffs are ~1e-6.
    np.testing.assert_allclose(got[valid], expected[valid], atol=2e-5, rtol=0)


def test_minilm_hidden_states_and_mean_pooled_embeddings_match_transformers():
    folder = minilm_path()
    config = json.loads((folder / "config.json").read_text())
    batch = load_tokenizer(folder).encode(SENTENCES, seq_len=24)
    assert batch.attention_mask.min() == 0  # the batch really is padded
    expected = _reference_hidden(folder, batch.input_ids, batch.attention_mask)
    model = build(config)
    params = _params(folder)
    got = np.asarray(forward_layerwise(model, params, batch.input_ids, batch.attention_mask))
    valid = batch.attention_mask.astype(bool)
    # Hidden states reach |h| ~ 6; the measured max abs diff is ~3e-6.
    np.testing.assert_allclose(got[valid], expected[valid], atol=2e-5, rtol=0)

    # sentence-transformers' mean pooling, written out in numpy on the reference.
    m = batch.attention_mask[..., None].astype(np.float32)
    expected_pooled = (expected * m).sum(1) / m.sum(1)
    pooled = np.asarray(model.sentence_embeddings(params, batch.input_ids, batch.attention_mask))
    np.testing.assert_allclose(pooled, expected_pooled, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(mean_pool(jnp.asarray(expected), batch.attention_mask)),
                               expected_pooled, atol=1e-6, rtol=0)


def test_minilm_tokenizer_matches_transformers_tokenizer():
    folder = minilm_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = reference(SENTENCES, padding="max_length", truncation=True, max_length=12, return_tensors="np")
    batch = load_tokenizer(folder).encode(SENTENCES, seq_len=12)
    np.testing.assert_array_equal(batch.input_ids, want["input_ids"])
    np.testing.assert_array_equal(batch.attention_mask, want["attention_mask"])
    assert batch.input_ids.dtype == np.int32


def test_tiny_tokenizer_encodes_to_fixed_length_with_bos_and_padding(tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path, vocab_size=64))
    batch = tok.encode(["The time of day", "one " * 20], seq_len=8)
    # <s>=1, then the words' ids in the word list: the=4, time=73? computed from the vocabulary file.
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert batch.input_ids[0].tolist() == [1, vocab["the"], vocab.get("time", 3), vocab["of"],
                                           vocab.get("day", 3), 0, 0, 0]
    assert batch.attention_mask.tolist() == [[1] * 5 + [0] * 3, [1] * 8]
    assert batch.input_ids[1].tolist() == [1] + [vocab["one"]] * 7
    assert tok.pad_id == 0 and max(vocab.values()) == 63
