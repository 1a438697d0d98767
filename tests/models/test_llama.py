"""The Llama-family JAX forward matches transformers (float32) on tiny random checkpoints."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from checkpoints import make_llama_checkpoint
from qconvert.models import build
from qconvert.calibration.layers import forward_layerwise, iterate_layers
from qconvert.models.rope import RopeConfig, inverse_frequencies

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 on both sides; measured max abs diff is ~5e-7 on logits of scale ~1.5,
# so 1e-5 of the logits' scale leaves room for summation order only.
RTOL = 1e-5


class LazyCheckpoint(Mapping):
    """Reads each tensor from the safetensors file only when asked; records what was read."""

    def __init__(self, folder: Path):
        self.path = str(Path(folder) / "model.safetensors")
        with safe_open(self.path, "numpy") as f:
            self.names = list(f.keys())
        self.reads: list[str] = []

    def __getitem__(self, name):
        if name not in self.names:
            raise KeyError(name)
        self.reads.append(name)
        with safe_open(self.path, "numpy") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _edit_config(folder: Path, **changes) -> dict:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return config


def _batch(vocab: int, batch: int = 2, seq: int = 10, seed: int = 1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, size=(batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.int32)
    mask[1, -3:] = 0  # right padding in the second sample
    return ids, mask


def _built_llama(tmp_path, layers: int, batch: int = 2):
    """A random Llama of `layers` layers: its built model, a batch (ids, mask) and its LazyCheckpoint."""
    folder = make_llama_checkpoint(tmp_path, layers=layers)
    config = json.loads((folder / "config.json").read_text())
    model = build(config)
    ids, mask = _batch(config["vocab_size"], batch=batch)
    return model, ids, mask, LazyCheckpoint(folder)


def _reference_logits(folder: Path, ids, mask) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits.numpy()


def _assert_logits_match(folder: Path, config: dict, seq: int = 10):
    ids, mask = _batch(config["vocab_size"], seq=seq)
    expected = _reference_logits(folder, ids, mask)
    model = build(config)
    got = np.asarray(model.forward(LazyCheckpoint(folder), jnp.asarray(ids), jnp.asarray(mask)))
    valid = mask.astype(bool)
    scale = np.abs(expected[valid]).max()
    err = np.abs(got[valid] - expected[valid]).max()
    assert err <= RTOL * scale, f"max abs diff {err} vs logits scale {scale}"
    return model, got


def test_llama_gqa_logits_match_transformers(tmp_path):
    folder = make_llama_checkpoint(tmp_path, heads=4, kv_heads=2)
    _assert_logits_match(folder, json.loads((folder / "config.json").read_text()))


def test_left_padded_batch_matches_transformers_on_real_tokens(tmp_path):
    folder = make_llama_checkpoint(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    ids, mask = _batch(config["vocab_size"])
    mask = mask[:, ::-1].copy()  # padding on the left: positions still count from 0, as transformers
    expected = _reference_logits(folder, ids, mask)
    got = np.asarray(build(config).forward(LazyCheckpoint(folder), ids, mask))
    valid = mask.astype(bool)
    assert np.abs(got[valid] - expected[valid]).max() <= RTOL * np.abs(expected[valid]).max()


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    folder = make_llama_checkpoint(tmp_path, hidden=64, heads=2, kv_heads=1)
    # head_dim 32 with original context 16 puts frequencies in all three llama3 bands.
    config = _edit_config(folder, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    _assert_logits_match(folder, config, seq=12)


def test_llama3_inverse_frequencies_hand_worked():
    rope = RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=64)
    inv = inverse_frequencies(rope, 8)  # base frequencies 1, 0.1, 0.01, 0.001
    wavelen = 2 * np.pi / np.array([1, 0.1, 0.01, 0.001])
    # wavelengths 6.3 (< 64/4: kept), 62.8 (between 16 and 64: interpolated), 628, 6283 (> 64: / 8)
    smooth = (64 / wavelen[1] - 1) / 3
    want = [1.0, (1 - smooth) * 0.1 / 8 + smooth * 0.1, 0.01 / 8, 0.001 / 8]
    np.testing.assert_allclose(inv, want, rtol=1e-6)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    folder = make_llama_checkpoint(tmp_path)
    config = _edit_config(folder, rope_scaling={"type": "linear", "factor": 4.0})
    _assert_logits_match(folder, config)


def test_rope_parameters_key_of_transformers_5_is_read():
    config = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}
    assert RopeConfig.from_config(config) == RopeConfig(theta=1000.0, rope_type="linear", factor=2.0,
                                                        original_max_position_embeddings=8192)


def test_mistral_sliding_window_shorter_than_sequence(tmp_path):
    folder = make_llama_checkpoint(tmp_path, architecture="MistralForCausalLM")
    config = _edit_config(folder, sliding_window=3)
    model, got = _assert_logits_match(folder, config, seq=10)
    # The window must matter here, else the test proves nothing.
    full = build({**config, "sliding_window": None})
    ids, mask = _batch(config["vocab_size"], seq=10)
    no_window = np.asarray(full.forward(LazyCheckpoint(folder), ids, mask))
    assert np.abs(no_window - got)[:, 5:].max() > 1e-3


def test_qwen2_biases_and_per_layer_window_match_transformers(tmp_path):
    folder = make_llama_checkpoint(tmp_path, architecture="Qwen2ForCausalLM", layers=3)
    config = _edit_config(folder, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model, _ = _assert_logits_match(folder, config)
    assert model.args.sliding_windows == (None, 4, 4)
    assert "model.layers.0.self_attn.q_proj.bias" in model.layer_tensor_names(0)


def test_tied_embeddings_match_transformers(tmp_path):
    folder = make_llama_checkpoint(tmp_path, tie=True)
    _assert_logits_match(folder, json.loads((folder / "config.json").read_text()))


def test_layerwise_runner_reads_one_layer_at_a_time_and_matches_forward(tmp_path):
    model, ids, mask, params = _built_llama(tmp_path, layers=3, batch=3)
    steps = iterate_layers(model, params, ids, mask, batch_size=2)
    first = next(steps)
    # Nothing of layers 1 and 2 has been read while layer 0 is observed.
    assert not any(".layers.1." in n or ".layers.2." in n for n in params.reads)
    assert set(model.layer_tensor_names(0)) <= set(params.reads)
    for _ in steps:
        pass
    expected = np.asarray(model.forward(params, ids, mask))
    got = np.asarray(forward_layerwise(model, params, ids, mask, batch_size=2))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert first.index == 0


def test_runner_observes_each_linear_input_under_jit(tmp_path):
    model, ids, mask, params = _built_llama(tmp_path, layers=1, batch=3)

    def absmax(name, x, valid):
        return jnp.max(jnp.where(valid[..., None], jnp.abs(x), 0.0), axis=tuple(range(x.ndim - 1)))

    (result,) = list(iterate_layers(model, params, ids, mask, observe=absmax, batch_size=2))
    assert sorted(result.observed) == sorted(model.layer_linears(0))
    assert [len(v) for v in result.observed.values()] == [2] * 7  # two micro-batches

    # Independent reference: q_proj's input is RMSNorm(embedding) of the real tokens.
    emb = params["model.embed_tokens.weight"][ids]
    g = params["model.layers.0.input_layernorm.weight"]
    normed = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True) + 1e-6) * g
    want = np.abs(normed[mask.astype(bool)]).max(0)
    got = np.max(np.stack(result.observed["model.layers.0.self_attn.q_proj"]), axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_every_linear_goes_through_the_hook(tmp_path):
    model, ids, mask, params = _built_llama(tmp_path, layers=2)
    called = []

    def spy(name, x, weight, bias):
        called.append(name)
        return jnp.zeros(x.shape[:-1] + (weight.shape[0],))

    logits = model.forward(params, ids, mask, linear=spy)
    assert called == model.layer_linears(0) + model.layer_linears(1) + ["lm_head"]
    assert np.all(np.asarray(logits) == 0)
