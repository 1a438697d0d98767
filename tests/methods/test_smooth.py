"""SmoothQuant scales and folds against hand-written numpy, and the --alpha grammar."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qconvert.formats.errors import UsageError
from qconvert.models.family import SmoothingGroup
from qconvert.methods.fold import apply_fold, channel_map, tensor_folds
from qconvert.methods.smooth import group_scales, search_alpha, smooth_scales
from qconvert.options import AlphaSpec, parse_alpha


def numpy_scales(act_absmax, weights, alpha):
    """The SmoothQuant formula written out channel by channel, in float32."""
    s = []
    for j in range(len(act_absmax)):
        w_max = max(float(np.abs(w[:, j]).max()) for w in weights)
        a = max(float(act_absmax[j]), 1e-5)
        s.append(max(np.float32(a) ** np.float32(alpha) / np.float32(max(w_max, 1e-5)) ** np.float32(1 - alpha),
                     1e-5))
    return np.asarray(s, np.float32)


@settings(max_examples=15, deadline=None)
@given(alpha=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_smooth_scales_equal_hand_computed_numpy(alpha, seed):
    rng = np.random.default_rng(seed)
    act = np.abs(rng.standard_normal(16)).astype(np.float32) * 10
    act[3] = 0.0  # a dead channel hits the clamp
    weights = [rng.standard_normal((o, 16)).astype(np.float32) for o in (8, 4, 4)]
    group = SmoothingGroup("n", ("a", "b", "c"))
    got = group_scales(group, act, weights, alpha)
    np.testing.assert_allclose(got.input_scales, numpy_scales(act, weights, alpha), rtol=2e-6)
    assert got.input_scales.dtype == np.float32


def test_scales_are_clamped_at_1e_minus_5():
    s = smooth_scales(np.array([0.0, 1e-12, 4.0], np.float32), np.array([1.0, 1.0, 0.0], np.float32), 1.0)
    assert s[0] == np.float32(1e-5) and s[1] == np.float32(1e-5) and s[2] == np.float32(4.0)


def test_norm_fold_keeps_the_group_output_unchanged():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, 8)).astype(np.float32)
    gamma, beta = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    w = rng.standard_normal((6, 8)).astype(np.float32)
    x = h * gamma + beta  # a LayerNorm output (normalization itself is unaffected by s)
    scales = group_scales(SmoothingGroup("ln", ("fc",)), np.abs(x).max(0), [w], 0.5)
    folds = tensor_folds([scales])
    x2 = h * apply_fold(gamma, folds["ln.weight"]) + apply_fold(beta, folds["ln.bias"])
    w2 = apply_fold(w, folds["fc.weight"])
    np.testing.assert_allclose(x2 @ w2.T, x @ w.T, rtol=1e-5, atol=1e-5)
    # after smoothing, the per-channel activation maxima equal max|X|^(1-a) * max|W|^a
    expected = np.abs(x).max(0) ** 0.5 * np.abs(w).max(0) ** 0.5
    np.testing.assert_allclose(np.abs(x2).max(0), expected, rtol=1e-5)


def test_gqa_v_to_o_scale_is_shared_by_the_query_heads_of_a_kv_head():
    # 4 query heads, 2 KV heads, head_dim 3: o_proj input channel (head h, dim d) reads v row (h // 2, d)
    group = SmoothingGroup("v", ("o",), kv_repeat=2, head_dim=3)
    np.testing.assert_array_equal(channel_map(group, 12), [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5])
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 10)).astype(np.float32)
    wv = rng.standard_normal((6, 10)).astype(np.float32)
    wo = rng.standard_normal((5, 12)).astype(np.float32)

    def attn_out(wv):  # attention with all-equal weights on one token: each q head copies its kv head
        v = (x @ wv.T).reshape(7, 2, 3)
        return np.repeat(v, 2, axis=1).reshape(7, 12)

    act = np.abs(attn_out(wv)).max(0) * np.linspace(1, 40, 12).astype(np.float32)
    scales = group_scales(group, act, [wo], 0.7)
    s = scales.input_scales.reshape(4, 3)
    np.testing.assert_array_equal(s[0], s[1])
    np.testing.assert_array_equal(s[2], s[3])
    # the source channel's scale uses the max over the query heads that share it
    np.testing.assert_allclose(scales.source_scales[:3], numpy_scales(
        np.maximum(act[0:3], act[3:6]), [np.maximum(np.abs(wo[:, 0:3]), np.abs(wo[:, 3:6]))], 0.7), rtol=2e-6)
    folds = tensor_folds([scales])
    y = attn_out(apply_fold(wv, folds["v.weight"])) @ apply_fold(wo, folds["o.weight"]).T
    np.testing.assert_allclose(y, attn_out(wv) @ wo.T, rtol=1e-4, atol=1e-5)


def test_a_linear_in_two_groups_gets_its_columns_and_its_rows_scaled():
    rng = np.random.default_rng(2)
    wv = rng.standard_normal((4, 6)).astype(np.float32)
    col = group_scales(SmoothingGroup("norm", ("v",)), np.full(6, 3.0, np.float32), [wv], 0.5)
    row = group_scales(SmoothingGroup("v", ("o",)), np.full(4, 2.0, np.float32),
                       [rng.standard_normal((3, 4)).astype(np.float32)], 0.5)
    fold = tensor_folds([col, row])["v.weight"]
    expected = wv * col.input_scales[None, :] / row.source_scales[:, None]
    np.testing.assert_allclose(apply_fold(wv, fold), expected, rtol=1e-6)


def test_a_fused_source_divides_only_the_rows_from_its_offset():
    # A fused qkv-style source: rows 0-3 feed nothing in the group, rows 4-5 feed "o".
    w = np.arange(1, 13, dtype=np.float32).reshape(6, 2)
    group = SmoothingGroup("qkv", ("o",), source_offset=4)
    scales = group_scales(group, np.array([8.0, 2.0], np.float32), [np.ones((3, 2), np.float32)], 1.0)
    np.testing.assert_array_equal(scales.source_scales, [8.0, 2.0])  # alpha 1: s = max|X|
    fold = tensor_folds([scales])["qkv.weight"]
    expected = w.copy()
    expected[4] /= 8.0
    expected[5] /= 2.0
    np.testing.assert_array_equal(apply_fold(w, fold), expected)


def test_fold_keeps_bfloat16_dtype():
    import ml_dtypes

    w = np.ones((2, 3), ml_dtypes.bfloat16)
    scales = group_scales(SmoothingGroup("n", ("fc",)), np.ones(3, np.float32) * 4, [w.astype(np.float32)], 0.5)
    assert apply_fold(w, tensor_folds([scales])["fc.weight"]).dtype == ml_dtypes.bfloat16


def test_alpha_search_prefers_smoothing_when_activations_have_outliers():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    x[:, [2, 9]] *= 80.0  # outlier channels
    w = rng.standard_normal((16, 32)).astype(np.float32) * 0.05
    group = SmoothingGroup("n", ("fc",))
    best, tried = search_alpha(group, np.abs(x).max(0), [w], x, static=False)
    assert set(tried) == {round(0.05 * k, 2) for k in range(21)}
    assert best.alpha == min(tried, key=tried.get)
    assert best.alpha >= 0.3
    # the chosen alpha is far better than the grid's end that leaves outliers in the activations
    assert tried[best.alpha] < tried[0.0] / 5


def numpy_w8a8_relative_error(x, w, s, static):
    """Simulated W8A8 of one linear in float64: (X/s) int8 per token (or per tensor), W*s int8 per row."""
    x, w, s = (np.asarray(a, np.float64) for a in (x, w, s))

    def rows(a):
        scale = np.maximum(np.abs(a).max(axis=-1, keepdims=True) / 127, 1e-12)
        return np.clip(np.rint(a / scale), -127, 127) * scale

    xs = x / s
    if static:
        scale = np.abs(xs).max() / 127
        xq = np.clip(np.rint(xs / scale), -127, 127) * scale
    else:
        xq = rows(xs)
    y = x @ w.T
    return ((xq @ rows(w * s).T - y) ** 2).sum() / (y ** 2).sum()


@pytest.mark.parametrize("static", [False, True])
def test_batched_alpha_search_errors_equal_one_numpy_pass_per_alpha(static):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, 24)).astype(np.float32)
    x[:, 5] *= 40.0
    weights = [rng.standard_normal((n, 24)).astype(np.float32) * 0.05 for n in (16, 8, 8)]  # q, k, v
    group = SmoothingGroup("n", ("q", "k", "v"))
    act = np.abs(x).max(0)
    best, tried = search_alpha(group, act, weights, x, static=static)
    for alpha, error in tried.items():
        s = group_scales(group, act, weights, alpha).input_scales
        expected = np.mean([numpy_w8a8_relative_error(x, w, s, static) for w in weights])
        assert error == pytest.approx(expected, rel=2e-3, abs=1e-7), alpha
    assert best.alpha == min(tried, key=lambda a: (tried[a], a))


def test_parse_alpha_forms():
    assert parse_alpha(None).auto  # the default searches per group
    assert parse_alpha("auto").auto
    assert parse_alpha("family") == AlphaSpec()
    assert parse_alpha("family").alpha_for("model.layers.0.input_layernorm", 0.85) == 0.85
    assert parse_alpha("0.8").alpha_for("model.layers.0.input_layernorm", 0.5) == 0.8
    spec = parse_alpha("0.8, post_attention_layernorm=0.6, model.layers.1.post_attention_layernorm=0.7")
    assert spec.alpha_for("model.layers.0.input_layernorm", 0.5) == 0.8
    assert spec.alpha_for("model.layers.0.post_attention_layernorm", 0.5) == 0.6
    assert spec.alpha_for("model.layers.1.post_attention_layernorm", 0.5) == 0.7  # longest key wins
    assert parse_alpha("mlp.up_proj=0.3").alpha_for("model.layers.0.self_attn.v_proj", 0.85) == 0.85


@pytest.mark.parametrize("text", ["1.5", "-0.1", "abc", "0.5,0.6", "=0.5", ""])
def test_parse_alpha_rejects_bad_values(text):
    with pytest.raises(UsageError):
        parse_alpha(text)
