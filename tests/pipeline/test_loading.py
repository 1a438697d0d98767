"""qconvert.load: a converted folder as packed JAX parameters that the models' forward runs on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint
from ops_helpers import int8_qarray, nf4_values
from safetensors.numpy import load_file

import qconvert
from qconvert import models, ops
from qconvert.convert import ConvertOptions, convert
from qconvert.formats.errors import InvalidCheckpointError, ModelNotFoundError
from qconvert.formats import QArray
from qconvert.ops.dispatch import DEQUANTIZE, INT8_INT32

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    src = make_llama_checkpoint(root / "src", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=64)
    outs = {}
    for scheme in ("int8", "nf4"):
        outs[scheme] = root / scheme
        convert(str(src), outs[scheme], ConvertOptions(scheme=scheme))
    return src, outs


def _float_params(src):
    return {k: jnp.asarray(v) for k, v in load_file(str(src / "model.safetensors")).items()}


def test_int8_weights_load_packed_as_the_per_channel_quantization_of_the_source(llama):
    src, outs = llama
    params = qconvert.load(outs["int8"])
    source = load_file(str(src / "model.safetensors"))
    for i in range(2):
        for linear in LINEARS:
            leaf = params["model"]["layers"][str(i)][linear.split(".")[0]][linear.split(".")[1]]["weight"]
            assert isinstance(leaf, QArray) and leaf.kind == "int8" and leaf.qvalue.dtype == jnp.int8
            expected = int8_qarray(source[f"model.layers.{i}.{linear}.weight"], shared_axes=(1,))
            np.testing.assert_array_equal(np.asarray(leaf.qvalue), expected.qvalue)
            np.testing.assert_allclose(np.asarray(leaf.scale), expected.scale, rtol=1e-7)
    assert isinstance(params["model"]["embed_tokens"]["weight"], jax.Array)
    np.testing.assert_array_equal(np.asarray(params["lm_head"]["weight"]), source["lm_head.weight"])


def test_nf4_weights_stay_packed_and_decode_close_to_the_source(llama):
    src, outs = llama
    flat = qconvert.flatten_params(qconvert.load(outs["nf4"]))
    source = load_file(str(src / "model.safetensors"))
    w = flat["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(w, QArray) and w.kind == "nf4" and w.qvalue.dtype == jnp.uint8
    assert w.qvalue.size == w.size // 2  # two codes per byte, never a float copy
    original = source["model.layers.0.mlp.up_proj.weight"]
    absmax = np.abs(original.reshape(-1, 64)).max(axis=1)
    err = np.abs(nf4_values(w) - original).reshape(-1, 64)
    assert np.all(err <= 0.5 * 0.35 * absmax[:, None] + 1e-6)  # within half the widest NF4 level gap


@pytest.mark.parametrize("scheme", ["int8", "nf4"])
def test_models_forward_runs_on_loaded_params_with_ops_linear(llama, scheme):
    src, outs = llama
    model = models.build(qconvert.load_config(outs[scheme]))
    flat = qconvert.flatten_params(qconvert.load(outs[scheme]))
    ids = jnp.array([[1, 5, 9, 13, 2, 40]], jnp.int32)
    with ops.record_paths() as decisions:
        logits = jax.jit(lambda p, x: model.forward(p, x, linear=ops.linear))(flat, ids)
    reference = model.forward(flat, ids)  # the float hook: dequantizes every weight
    float_logits = model.forward(_float_params(src), ids)
    assert logits.shape == (1, 6, 64)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), rtol=1e-4, atol=1e-4)
    cos = jnp.sum(logits * float_logits) / (jnp.linalg.norm(logits) * jnp.linalg.norm(float_logits))
    assert float(cos) > 0.99
    assert {d.op for d in decisions} == {"linear"} and len(decisions) == 2 * len(LINEARS) + 1


def test_w8a8_style_linear_takes_the_integer_path_on_loaded_weights(llama):
    _, outs = llama
    flat = qconvert.flatten_params(qconvert.load(outs["int8"]))
    w = flat["model.layers.1.mlp.down_proj.weight"]
    x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    xq = int8_qarray(x, shared_axes=(1,))  # per-token activations
    with ops.record_paths() as decisions:
        y = ops.dot_general(xq, w, (((1,), (1,)), ((), ())))
    assert decisions[0].path == INT8_INT32
    w_values = np.asarray(w.qvalue, np.float32) * np.asarray(w.scale, np.float32)
    np.testing.assert_allclose(np.asarray(y), (np.asarray(xq.qvalue, np.float32) * xq.scale) @ w_values.T,
                               rtol=1e-5, atol=1e-5)
    with ops.record_paths() as decisions:
        ops.dot_general(x, w, (((1,), (1,)), ((), ())))
    assert decisions[0].path == DEQUANTIZE


def test_params_are_a_pytree_with_packed_leaves(llama):
    _, outs = llama
    params = qconvert.load(outs["nf4"])
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(params)}
    assert jnp.dtype(jnp.uint8) in dtypes
    assert qconvert.unflatten_params(qconvert.flatten_params(params)).keys() == params.keys()


def test_load_errors_say_what_to_do(tmp_path, llama):
    with pytest.raises(ModelNotFoundError):
        qconvert.load(tmp_path / "missing")
    src, _ = llama
    with pytest.raises(InvalidCheckpointError, match="quantization_config"):
        qconvert.load(src)  # a float checkpoint, not a converted one
