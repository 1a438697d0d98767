"""all-MiniLM-L6-v2 through --scheme w8a8: its sentence embeddings stay within cosine 0.99 of the float ones."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from checkpoints import minilm_path

from qconvert.calibration.observer import open_params
from qconvert.convert import ConvertOptions
from qconvert.formats.layouts import open_quantized
from qconvert.formats.qarray import QArray
from qconvert.models import build, dense_linear
from qconvert.calibration.tokenizer import load_tokenizer
from qconvert.convert import convert
from qconvert.options import CalibrationOptions

SENTENCES = [
    "A man is playing a guitar on the street.",
    "The weather will be cold and rainy tomorrow morning.",
    "Quantization stores weights in eight bits instead of thirty-two.",
    "She bought fresh bread and cheese at the market.",
    "The committee postponed its decision until next spring.",
    "How many kilometres is it from the coast to the hills?",
    "Children were playing football in the park after school.",
    "The stock market fell sharply after the announcement.",
]


def w8a8_linear(name, x, weight, bias):
    """Simulated W8A8, written here: per-token int8 activations times per-channel int8 weights."""
    if not isinstance(weight, QArray):
        return dense_linear(name, x, weight, bias)
    x = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0, 1e-12)
    x_q = jnp.clip(jnp.round(x / x_scale), -127, 127)
    acc = jnp.matmul(x_q, jnp.asarray(weight.qvalue, jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    y = acc * x_scale * jnp.asarray(weight.scale, jnp.float32).reshape(1, -1)
    return y + jnp.asarray(bias, jnp.float32)


def cosine(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_minilm_w8a8_sentence_embeddings_match_float(tmp_path):
    folder = minilm_path()
    config = json.loads((folder / "config.json").read_text())
    out = tmp_path / "minilm-w8a8"
    convert(str(folder), out, ConvertOptions(scheme="w8a8", calibration=CalibrationOptions(
        calib="builtin", calib_samples=4, calib_seqlen=128, alpha="family")))
    manifest = json.loads((out / "qconvert.json").read_text())
    assert manifest["calibration"]["source"] == "builtin"
    assert manifest["smoothing"]["alpha"]["encoder.layer.0.attention.self.value"] == 0.5

    batch = load_tokenizer(folder).encode(SENTENCES, seq_len=24)
    ids, mask = jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask)
    model = build(config)
    reference = model.sentence_embeddings(open_params(folder), ids, mask)

    q = open_quantized(out)
    params = {name: np.asarray(q.get(name)) for name in q.float_names}
    params.update({f"{m}.weight": q.qarray(m) for m in q.quantized_modules})
    assert len(q.quantized_modules) == 36
    quantized = model.sentence_embeddings(params, ids, mask, linear=w8a8_linear)
    cos = cosine(quantized, reference)
    assert cos.mean() >= 0.99, cos
    assert cos.min() >= 0.97, cos
