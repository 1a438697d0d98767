"""qconvert.ops.dot_general / dot / einsum against jax.lax and jax.numpy on the dequantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ops_helpers import int8_qarray, int8_values, nf4_qarray, nf4_values

from qconvert import ops
from qconvert.ops.dispatch import DEQUANTIZE, INT8_INT32, INT8_KERNEL

HIGHEST = jax.lax.Precision.HIGHEST
FAST = (INT8_INT32, INT8_KERNEL)


@st.composite
def dot_problems(draw):
    """Random shapes and dimension_numbers (batch, several contracting, free dims in any order)."""
    n_batch = draw(st.integers(0, 2))
    n_contract = draw(st.integers(1, 3))
    n_lhs_free = draw(st.integers(0, 2))
    n_rhs_free = draw(st.integers(0, 2))
    size = st.integers(1, 4)
    batch = [draw(size) for _ in range(n_batch)]
    contract = [draw(size) for _ in range(n_contract)]
    lhs_labels = [("b", i) for i in range(n_batch)] + [("c", i) for i in range(n_contract)] + [("l", i) for i in range(n_lhs_free)]
    rhs_labels = [("b", i) for i in range(n_batch)] + [("c", i) for i in range(n_contract)] + [("r", i) for i in range(n_rhs_free)]
    lhs_labels = draw(st.permutations(lhs_labels))
    rhs_labels = draw(st.permutations(rhs_labels))
    sizes = {("b", i): s for i, s in enumerate(batch)} | {("c", i): s for i, s in enumerate(contract)}
    sizes |= {("l", i): draw(size) for i in range(n_lhs_free)} | {("r", i): draw(size) for i in range(n_rhs_free)}
    dn = (
        (tuple(lhs_labels.index(("c", i)) for i in range(n_contract)), tuple(rhs_labels.index(("c", i)) for i in range(n_contract))),
        (tuple(lhs_labels.index(("b", i)) for i in range(n_batch)), tuple(rhs_labels.index(("b", i)) for i in range(n_batch))),
    )
    lhs_shape = tuple(sizes[lab] for lab in lhs_labels)
    rhs_shape = tuple(sizes[lab] for lab in rhs_labels)
    quantized = draw(st.sampled_from(["lhs", "rhs", "both"]))
    # "channel": scale shared along all contracting dims (factors out); "element": it does not.
    granularity = draw(st.sampled_from(["channel", "channel", "element"]))
    seed = draw(st.integers(0, 2**16))
    return lhs_shape, rhs_shape, dn, quantized, granularity, seed


def _quantize(x, contracting, granularity):
    if granularity == "channel":
        return int8_qarray(x, shared_axes=contracting)
    return int8_qarray(x)  # a scale per element: varies along the contraction


@settings(max_examples=25, deadline=None)
@given(dot_problems())
def test_dot_general_matches_lax_on_dequantized_operands(problem):
    lhs_shape, rhs_shape, dn, quantized, granularity, seed = problem
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal(lhs_shape).astype(np.float32)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    lhs_op = _quantize(lhs, dn[0][0], granularity) if quantized in ("lhs", "both") else lhs
    rhs_op = _quantize(rhs, dn[0][1], granularity) if quantized in ("rhs", "both") else rhs
    lhs_ref = int8_values(lhs_op) if quantized in ("lhs", "both") else lhs
    rhs_ref = int8_values(rhs_op) if quantized in ("rhs", "both") else rhs
    ref = jax.lax.dot_general(lhs_ref, rhs_ref, dn, precision=HIGHEST)

    with ops.record_paths() as decisions:
        out = ops.dot_general(lhs_op, rhs_op, dn, precision=HIGHEST)

    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * (1 + np.abs(ref).max(initial=0)))
    assert len(decisions) == 1
    # A per-element scale still factors out when every contracting dim has size 1.
    factors_out = granularity == "channel" or all(lhs_shape[d] == 1 for d in dn[0][0])
    expect_fast = quantized == "both" and factors_out
    assert (decisions[0].path in FAST) == expect_fast, decisions[0]


def test_fast_path_is_bit_exact_against_an_int32_reference():
    rng = np.random.default_rng(1)
    # [batch, tokens, k1, k2] x [batch, k2, out, k1]: a batch dim and two contracting dims.
    lhs = int8_qarray(rng.standard_normal((2, 5, 3, 4)), shared_axes=(2, 3))
    rhs = int8_qarray(rng.standard_normal((2, 4, 6, 3)), shared_axes=(0, 1, 3))  # per output channel
    dn = (((2, 3), (3, 1)), ((0,), (0,)))
    with ops.record_paths() as decisions:
        out = ops.dot_general(lhs, rhs, dn)
    assert decisions[0].path == INT8_INT32

    acc = np.einsum("btij,bjoi->bto", np.asarray(lhs.qvalue, np.int64), np.asarray(rhs.qvalue, np.int64))
    assert np.abs(acc).max() < 2**31
    lhs_scale = np.asarray(lhs.scale, np.float32)[:, :, 0, 0][:, :, None]  # [b, t, 1]
    rhs_scale = np.asarray(rhs.scale, np.float32)[0, 0, :, 0][None, None, :]  # [1, 1, o]
    expected = (acc.astype(np.int32).astype(np.float32) * lhs_scale) * rhs_scale
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_fast_path_shows_an_int8_dot_with_int32_accumulation_in_the_jaxpr():
    rng = np.random.default_rng(2)
    lhs = int8_qarray(rng.standard_normal((3, 8)), shared_axes=(1,))
    rhs = int8_qarray(rng.standard_normal((2, 8, 4)), shared_axes=(1,))
    dn = (((1,), (1,)), ((), ()))
    jaxpr = jax.make_jaxpr(lambda a, b: ops.dot_general(a, b, dn))(lhs, rhs)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    assert [v.aval.dtype for v in dots[0].invars] == [jnp.int8, jnp.int8]
    assert dots[0].outvars[0].aval.dtype == jnp.int32


def test_slow_path_dequantizes_when_one_side_is_float():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = int8_qarray(rng.standard_normal((5, 8)), shared_axes=(1,))
    dn = (((1,), (1,)), ((), ()))
    jaxpr = jax.make_jaxpr(lambda a, b: ops.dot_general(a, b, dn))(x, w)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for v in dots[0].invars] == [jnp.float32, jnp.float32]
    with ops.record_paths() as decisions:
        ops.dot_general(x, w, dn)
    assert decisions[0].path == DEQUANTIZE and "lhs is not quantized" in decisions[0].reason


@pytest.mark.parametrize("preferred", [None, jnp.float32, jnp.bfloat16])
def test_output_dtype_follows_lax_rules_for_bf16_operands(preferred):
    rng = np.random.default_rng(4)
    lhs = int8_qarray(rng.standard_normal((4, 16)), shared_axes=(1,), dtype="bfloat16")
    rhs = int8_qarray(rng.standard_normal((16, 3)), shared_axes=(0,), dtype="bfloat16")
    dn = (((1,), (0,)), ((), ()))
    ref = jax.lax.dot_general(lhs.dequantize(), rhs.dequantize(), dn, preferred_element_type=preferred)
    out = ops.dot_general(lhs, rhs, dn, preferred_element_type=preferred)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


def test_nf4_weight_matches_dot_on_decoded_weight():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    w = nf4_qarray(rng.standard_normal((8, 64)))
    out = ops.dot_general(x, w, (((2,), (1,)), ((), ())))
    ref = np.einsum("btk,nk->btn", x, nf4_values(w))
    assert out.shape == (2, 3, 8)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_shape,b_shape", [((5,), (5,)), ((3, 5), (5,)), ((3, 5), (5, 4)), ((2, 3, 5), (4, 5, 6))])
def test_dot_matches_jnp_dot(a_shape, b_shape):
    rng = np.random.default_rng(6)
    a = int8_qarray(rng.standard_normal(a_shape), shared_axes=(len(a_shape) - 1,))
    b_axis = 0 if len(b_shape) == 1 else len(b_shape) - 2
    b = int8_qarray(rng.standard_normal(b_shape), shared_axes=(b_axis,))
    ref = jnp.dot(int8_values(a), int8_values(b), precision=HIGHEST)
    with ops.record_paths() as decisions:
        out = ops.dot(a, b)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert decisions[0].path in FAST


@pytest.mark.parametrize(
    "subscripts,shapes,quantized",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)], (True, True)),
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], (True, False)),
        ("ij,kj", [(3, 4), (5, 4)], (False, True)),
        ("...ij,jk->...ik", [(2, 2, 3, 4), (4, 5)], (True, True)),
        ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)], (True, True)),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)], (True, True, False)),
        ("ijk,jl->il", [(2, 3, 4), (3, 5)], (True, True)),
        ("ii->i", [(3, 3)], (True,)),
    ],
)
def test_einsum_matches_jnp_einsum(subscripts, shapes, quantized):
    rng = np.random.default_rng(7)
    floats = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    operands = [int8_qarray(x, shared_axes=(x.ndim - 1,)) if q else x for x, q in zip(floats, quantized)]
    ref_inputs = [int8_values(o) if q else o for o, q in zip(operands, quantized)]
    ref = jnp.einsum(subscripts, *ref_inputs, precision=HIGHEST)
    out = ops.einsum(subscripts, *operands, precision=HIGHEST)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_einsum_takes_the_fast_path_for_a_matmul_over_quantized_channels():
    rng = np.random.default_rng(8)
    x = int8_qarray(rng.standard_normal((2, 3, 8)), shared_axes=(2,))  # per token
    w = int8_qarray(rng.standard_normal((5, 8)), shared_axes=(1,))  # per output channel
    with ops.record_paths() as decisions:
        out = ops.einsum("btk,nk->btn", x, w, preferred_element_type=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 3, 5)
    assert [d.path for d in decisions] in ([INT8_INT32], [INT8_KERNEL])
