"""qconvert.load(OUT, prepare=True): each dense quantized weight laid out for its kernel once, at load time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import make_llama_checkpoint

import qconvert
import qconvert.kernels.tiles as tiles
from qconvert import models, ops
from qconvert.convert import ConvertOptions, convert
from qconvert.formats import QArray
from qconvert.formats.errors import UsageError
from qconvert.kernels.prepared import PreparedWeight
from qconvert.ops.dispatch import PREPARED

SCHEMES = ("int8", "int4", "nf4")
DENSE_LINEARS = 7  # q, k, v, o, gate, up, down of the one layer; lm_head stays float
IDS = jnp.array([[1, 5, 9, 13, 2, 40]], jnp.int32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    src = make_llama_checkpoint(root / "src", hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=64)
    outs = {}
    for scheme in SCHEMES:
        outs[scheme] = root / scheme
        convert(str(src), outs[scheme], ConvertOptions(scheme=scheme, gptq=False, awq=False))  # int4: round to nearest
    return outs


@pytest.fixture
def pack_calls(monkeypatch):
    """Every call of the int4 packing function (prepare_int4 and the per-call kernel launch both use it)."""
    calls = []
    original = tiles.pack_int4_pairs

    def counted(codes):
        calls.append(jnp.shape(codes))
        return original(codes)

    monkeypatch.setattr(tiles, "pack_int4_pairs", counted)
    return calls


def _forward(folder, flat, jit=False):
    model = models.build(qconvert.load_config(folder))
    run = lambda p, ids: model.forward(p, ids, linear=ops.linear)  # noqa: E731
    return np.asarray((jax.jit(run) if jit else run)(flat, IDS))


def test_prepare_gives_a_prepared_leaf_per_dense_quantized_weight_and_packs_int4_by_hand(folders):
    plain = qconvert.flatten_params(qconvert.load(folders["int4"]))
    prepared = qconvert.flatten_params(qconvert.load(folders["int4"], prepare=True))
    kinds = {name: type(leaf).__name__ for name, leaf in prepared.items() if not isinstance(leaf, jax.Array)}
    assert len(kinds) == DENSE_LINEARS and set(kinds.values()) == {"PreparedWeight"}
    assert isinstance(prepared["model.embed_tokens.weight"], jax.Array)
    q, p = plain["model.layers.0.mlp.down_proj.weight"], prepared["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(q, QArray) and isinstance(p, PreparedWeight) and (p.kind, p.n, p.k) == ("int4", 64, 128)
    codes = np.asarray(q.qvalue).astype(np.int32)
    expected = ((codes[:, 1::2] & 0xF) << 4 | (codes[:, 0::2] & 0xF)).astype(np.uint8).view(np.int8)
    np.testing.assert_array_equal(np.asarray(p.w), expected)  # column 2j low nibble, 2j + 1 high
    np.testing.assert_array_equal(np.asarray(p.scale), np.asarray(q.scale, np.float32).reshape(64, -1))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepared_and_qarray_weights_give_the_same_logits(folders, scheme):
    plain = qconvert.flatten_params(qconvert.load(folders[scheme]))
    prepared = qconvert.flatten_params(qconvert.load(folders[scheme], prepare=True))
    # Kernel backend xla: both run the kernels' XLA contract on the same codes, so bit for bit.
    with ops.use_kernels("xla"):
        with ops.record_paths() as decisions:
            ours = _forward(folders[scheme], prepared, jit=True)
        np.testing.assert_array_equal(ours, _forward(folders[scheme], plain, jit=True))
    assert sum(d.path == PREPARED for d in decisions) == DENSE_LINEARS


def test_on_the_cpu_default_prepared_logits_match_the_dequantizing_path_to_float_tolerance(folders):
    plain = qconvert.flatten_params(qconvert.load(folders["int8"]))
    prepared = qconvert.flatten_params(qconvert.load(folders["int8"], prepare=True))
    # The QArray dequantizes next to XLA's dot; the prepared weight runs the kernels' XLA contract (scale last).
    np.testing.assert_allclose(_forward(folders["int8"], prepared, jit=True),
                               _forward(folders["int8"], plain, jit=True), rtol=1e-5, atol=1e-5)
    # The float hook (no ops) decodes a prepared weight to the values its QArray dequantizes to.
    model = models.build(qconvert.load_config(folders["int8"]))
    forward = jax.jit(model.forward)
    np.testing.assert_allclose(np.asarray(forward(prepared, IDS)), np.asarray(forward(plain, IDS)),
                               rtol=1e-5, atol=1e-5)


def test_int4_codes_are_packed_once_per_weight_at_load_and_never_in_a_forward(folders, pack_calls):
    prepared = qconvert.flatten_params(qconvert.load(folders["int4"], prepare=True))
    assert len(pack_calls) == DENSE_LINEARS
    _forward(folders["int4"], prepared)
    _forward(folders["int4"], prepared, jit=True)  # traced and compiled with the prepared leaves as inputs
    assert len(pack_calls) == DENSE_LINEARS


def test_the_interpreted_kernel_packs_a_qarray_per_call_and_a_prepared_weight_never(folders, pack_calls):
    q = qconvert.flatten_params(qconvert.load(folders["int4"]))["model.layers.0.self_attn.q_proj.weight"]
    prepared = qconvert.prepare_params({"proj.weight": q})["proj.weight"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    with ops.use_kernels("cpu"):
        packed_before = len(pack_calls)
        y_q = ops.linear("proj", x, q)
        assert len(pack_calls) == packed_before + 1  # the QArray path packs on the call
        y_p = jax.jit(lambda x, w: ops.linear("proj", x, w))(x, prepared)
    assert len(pack_calls) == packed_before + 1
    np.testing.assert_array_equal(np.asarray(y_p), np.asarray(y_q))  # one kernel, same operands


def test_a_gradient_through_a_prepared_weight_is_refused_and_through_its_qarray_flows(folders):
    q = qconvert.flatten_params(qconvert.load(folders["nf4"]))["model.layers.0.mlp.up_proj.weight"]
    prepared = qconvert.prepare_params({"up.weight": q})["up.weight"]
    x = jnp.ones((2, 64), jnp.float32)
    loss = lambda x, w: jnp.sum(ops.linear("up", x, w))  # noqa: E731
    with pytest.raises(ops.PreparedWeightError, match="inference-only.*prepare=False"):
        jax.grad(loss)(x, prepared)
    dx = jax.grad(loss)(x, q)
    np.testing.assert_allclose(np.asarray(dx), np.broadcast_to(np.asarray(q.dequantize(jnp.float32)).sum(0), (2, 64)),
                               rtol=1e-5, atol=1e-5)


def test_ops_other_than_a_linear_refuse_a_prepared_weight(folders):
    q = qconvert.flatten_params(qconvert.load(folders["int8"]))["model.layers.0.self_attn.o_proj.weight"]
    prepared = qconvert.prepare_params({"o.weight": q})["o.weight"]
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ops.PreparedWeightError, match="only as x"):
        ops.dot_general(x, prepared, (((1,), (0,)), ((), ())))  # contracted on its out axis
    with pytest.raises(ops.PreparedWeightError, match="float result"):
        ops.dot_general(x, prepared, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    with pytest.raises(ops.PreparedWeightError):
        ops.grouped_linear(["e0", "e1"], x, [prepared, prepared], jnp.array([1, 1], jnp.int32))
    with pytest.raises(ops.PreparedWeightError):
        ops.einsum("mk,nk->mn", x, prepared)


def test_prepare_takes_only_a_bool(folders):
    with pytest.raises(UsageError, match="prepare must be True or False"):
        qconvert.load(folders["int8"], prepare="yes")
