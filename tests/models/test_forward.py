"""The forward-pass API around the families: QArray weights, eager hooks, config variants, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoints import make_llama_checkpoint
from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError
from qconvert.formats import QArray
from qconvert.models import build
from qconvert.calibration.layers import forward_layerwise, iterate_layers
from qconvert.calibration.tokenizer import load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny(tmp_path, **kwargs):
    folder = make_llama_checkpoint(tmp_path, **kwargs)
    config = json.loads((folder / "config.json").read_text())
    ids = np.random.default_rng(0).integers(3, config["vocab_size"], size=(2, 6)).astype(np.int32)
    return folder, config, load_file(str(folder / "model.safetensors")), ids


def test_int8_qarray_weights_run_as_their_dequantized_values(tmp_path):
    _, config, params, ids = _tiny(tmp_path, layers=1)
    name = "model.layers.0.mlp.down_proj.weight"
    w = params[name]
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127).astype(np.float32)
    codes = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    quantized = dict(params)
    quantized[name] = QArray(codes, scale, kind="int8", shape=w.shape, dtype="float32")
    by_hand = dict(params)
    by_hand[name] = codes.astype(np.float32) * scale
    model = build(config)
    got = np.asarray(forward_layerwise(model, quantized, ids))
    want = np.asarray(forward_layerwise(model, by_hand, ids))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.abs(got - np.asarray(forward_layerwise(model, params, ids))).max() > 0


def test_eager_runner_takes_hooks_with_python_side_effects(tmp_path):
    _, config, params, ids = _tiny(tmp_path, layers=2)
    model = build(config)
    seen = {}

    def recording_linear(name, x, weight, bias):
        seen[name] = float(np.abs(np.asarray(x)).max())  # needs concrete values: eager only
        return jnp.asarray(x) @ jnp.asarray(weight, jnp.float32).T

    results = list(iterate_layers(model, params, ids, linear=recording_linear, jit=False))
    assert [r.index for r in results] == [0, 1]
    assert sorted(seen) == sorted(model.layer_linears(0) + model.layer_linears(1))
    emb = params["model.embed_tokens.weight"][ids]
    g = params["model.layers.0.input_layernorm.weight"]
    normed = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True) + 1e-6) * g
    assert seen["model.layers.0.self_attn.k_proj"] == pytest.approx(np.abs(normed).max(), rel=1e-5)


def test_bfloat16_checkpoint_computes_in_float32(tmp_path):
    _, config, params, ids = _tiny(tmp_path / "bf16", layers=1, dtype="bfloat16")
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == ml_dtypes.bfloat16
    as_f32 = {k: v.astype(np.float32) for k, v in params.items()}
    model = build(config)
    got = forward_layerwise(model, params, ids)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(forward_layerwise(model, as_f32, ids)), atol=1e-6)


def test_head_dim_from_config_and_llama_biases_match_transformers(tmp_path):
    # head_dim 24 != hidden 64 / 4 heads, and bias on every attention and MLP linear.
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, attention_bias=True, mlp_bias=True, max_position_embeddings=64)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # zero-initialized biases become nonzero
    reference.save_pretrained(str(tmp_path))
    ids = np.random.default_rng(1).integers(0, 96, size=(2, 7))
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids)).logits.numpy()
    model = build(json.loads((tmp_path / "config.json").read_text()))
    assert model.args.head_dim == 24
    assert "model.layers.1.mlp.down_proj.bias" in model.layer_tensor_names(1)
    got = np.asarray(jax.jit(model.forward)(load_file(str(tmp_path / "model.safetensors")), ids))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_unsupported_rope_scaling_is_a_clear_error(tmp_path):
    _, config, _, _ = _tiny(tmp_path)
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        build(config)


def test_unsupported_activation_is_a_clear_error(tmp_path):
    _, config, _, _ = _tiny(tmp_path)
    config["hidden_act"] = "relu2"
    with pytest.raises(UnsupportedModelError, match="relu2"):
        build(config)


def test_unsupported_architecture_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        build({"architectures": ["GPT2LMHeadModel"]})


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidCheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
