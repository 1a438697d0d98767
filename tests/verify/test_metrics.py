"""verify's metrics and thresholds against hand-worked cases and direct numpy computations."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qconvert.formats.errors import UsageError
from qconvert.verify import metrics
from qconvert.verify.thresholds import DEFAULT_THRESHOLDS, check, thresholds_for


def test_sqnr_hand_worked():
    # signal energy 3^2 + 4^2 = 25, noise energy 0.5^2 = 0.25: ratio 100 -> 20 dB.
    assert metrics.sqnr_db([3.0, 4.0], [3.0, 4.5]) == pytest.approx(20.0)
    assert metrics.sqnr_db([1.0, 2.0], [1.0, 2.0]) == math.inf


def test_relative_error_and_cosine_hand_worked():
    # ||(0, 0.5)|| / ||(3, 4)|| = 0.5 / 5.
    assert metrics.relative_frobenius_error([3.0, 4.0], [3.0, 4.5]) == pytest.approx(0.1)
    assert metrics.cosine_similarity([1.0, 0.0], [0.0, 2.0]) == pytest.approx(0.0)
    assert metrics.cosine_similarity([1.0, 1.0], [2.0, 2.0]) == pytest.approx(1.0)
    assert metrics.cosine_similarity([1.0, 0.0], [1.0, 1.0]) == pytest.approx(1 / math.sqrt(2))
    assert metrics.max_abs_error([[1.0, -2.0]], [[1.5, 1.0]]) == pytest.approx(3.0)


def test_scale_off_by_two_is_zero_db():
    ref = np.random.default_rng(0).standard_normal((8, 16))
    assert metrics.sqnr_db(ref, 2 * ref) == pytest.approx(0.0, abs=1e-9)
    assert metrics.relative_frobenius_error(ref, 2 * ref) == pytest.approx(1.0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), noise=st.floats(1e-4, 1.0))
def test_tensor_metrics_match_numpy(seed, noise):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((5, 7)).astype(np.float32)
    out = ref + noise * rng.standard_normal((5, 7)).astype(np.float32)
    r, o = ref.astype(np.float64), out.astype(np.float64)
    m = metrics.tensor_metrics(ref, out)
    assert m.sqnr_db == pytest.approx(10 * np.log10((r**2).sum() / ((r - o) ** 2).sum()), rel=1e-9)
    assert m.rel_error == pytest.approx(np.sqrt(((r - o) ** 2).sum() / (r**2).sum()), rel=1e-9)
    assert m.cosine == pytest.approx((r * o).sum() / np.sqrt((r**2).sum() * (o**2).sum()), rel=1e-9)
    assert m.max_abs_error == pytest.approx(np.abs(r - o).max(), rel=1e-9)
    # SQNR and relative error are one quantity on two scales.
    assert m.sqnr_db == pytest.approx(-20 * np.log10(m.rel_error), rel=1e-9)


def test_kl_hand_worked():
    # P = softmax(log[0.5, 0.5]), Q = softmax(log[0.25, 0.75]):
    # KL = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75).
    p = np.log([[[0.5, 0.5]]])
    q = np.log([[[0.25, 0.75]]])
    expected = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)
    assert metrics.mean_kl_divergence(p, q) == pytest.approx(expected)
    assert metrics.mean_kl_divergence(p, p) == pytest.approx(0.0, abs=1e-15)


def test_kl_and_top1_respect_the_mask():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((2, 3, 5))
    test = ref.copy()
    test[1, 2] = -ref[1, 2]  # a position that disagrees, but is padding
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    assert metrics.mean_kl_divergence(ref, test, mask) == pytest.approx(0.0, abs=1e-12)
    assert metrics.top1_agreement(ref, test, mask) == 1.0
    assert metrics.top1_agreement(ref, test) == pytest.approx(5 / 6)


def test_kl_matches_numpy():
    rng = np.random.default_rng(2)
    ref, test = rng.standard_normal((2, 4, 11)), rng.standard_normal((2, 4, 11))
    p = np.exp(ref) / np.exp(ref).sum(-1, keepdims=True)
    q = np.exp(test) / np.exp(test).sum(-1, keepdims=True)
    expected = (p * np.log(p / q)).sum(-1).mean()
    assert metrics.mean_kl_divergence(ref, test) == pytest.approx(expected, rel=1e-10)


def test_perplexity_hand_worked():
    # Vocabulary of 4; at each position the model gives the next token probability 1/2.
    ids = np.array([[0, 1, 2]])
    logits = np.full((1, 3, 4), math.log(1 / 6))
    logits[0, 0, 1] = math.log(1 / 2)
    logits[0, 1, 2] = math.log(1 / 2)
    assert metrics.perplexity(logits, ids) == pytest.approx(2.0)
    # Uniform logits over V tokens: perplexity V.
    assert metrics.perplexity(np.zeros((2, 5, 7)), np.zeros((2, 5), int)) == pytest.approx(7.0)


def test_perplexity_skips_padding_pairs():
    ids = np.array([[0, 1, 3]])
    logits = np.zeros((1, 3, 4))
    logits[0, 0, 1] = 10.0  # near-certain first prediction
    mask = np.array([[1, 1, 0]])  # the pair (1 -> 3) involves padding
    expected = math.exp(-(10.0 - math.log(math.exp(10.0) + 3)))
    assert metrics.perplexity(logits, ids, mask) == pytest.approx(expected)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.sqnr_db(np.zeros(3), np.zeros(4))


def test_thresholds_defaults_and_overrides():
    assert thresholds_for("int8") == DEFAULT_THRESHOLDS["int8"]
    t = thresholds_for("nf4", min_layer_sqnr_db=12.5, max_mean_kl=None)
    assert t.min_layer_sqnr_db == 12.5
    assert t.max_mean_kl == DEFAULT_THRESHOLDS["nf4"].max_mean_kl
    with pytest.raises(UsageError, match="scheme"):
        thresholds_for("fp6")
    # Stricter schemes have higher floors.
    s = {k: v.min_layer_sqnr_db for k, v in DEFAULT_THRESHOLDS.items()}
    assert s["int8"] > s["w8a8"] > s["nf4"]


def test_check_bounds_and_nan():
    assert check("sqnr_db", "l", 31.0, 30.0, "min").passed
    assert not check("sqnr_db", "l", 29.0, 30.0, "min").passed
    assert check("mean_kl", "model", 0.001, 0.01, "max").passed
    assert not check("mean_kl", "model", float("nan"), 0.01, "max").passed
    assert check("sqnr_db", "l", 3.1, 30, "min").describe() == "l: sqnr_db 3.1 < 30"


def test_causal_lm_figures_match_numpy_on_a_masked_batch():
    rng = np.random.default_rng(5)
    ref, test = rng.standard_normal((3, 6, 13)), rng.standard_normal((3, 6, 13))
    ids = rng.integers(0, 13, (3, 6))
    mask = np.ones((3, 6), int)
    mask[2, 4:] = 0
    figures = metrics.causal_lm_figures(ref.astype(np.float32), test.astype(np.float32), ids, mask)
    r, t = ref.astype(np.float32).astype(np.float64), test.astype(np.float32).astype(np.float64)
    p = np.exp(r) / np.exp(r).sum(-1, keepdims=True)
    q = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
    keep = mask.astype(bool)
    assert figures["mean_kl"] == pytest.approx((p * np.log(p / q)).sum(-1)[keep].mean(), rel=1e-10)
    assert figures["top1_agreement"] == pytest.approx((r.argmax(-1) == t.argmax(-1))[keep].mean())
    pairs = keep[:, :-1] & keep[:, 1:]
    for key, probs in (("perplexity_float", p), ("perplexity_quantized", q)):
        nll = -np.log(np.take_along_axis(probs[:, :-1], ids[:, 1:, None], -1)[..., 0])
        assert figures[key] == pytest.approx(np.exp(nll[pairs].mean()), rel=1e-10)


@pytest.mark.parametrize("scale", [1e-120, 1e120])
def test_tensor_metrics_of_extreme_magnitudes_equal_the_scale_free_figures(scale):
    rng = np.random.default_rng(6)
    ref = rng.standard_normal((4, 9))
    out = ref + 0.01 * rng.standard_normal((4, 9))
    plain, extreme = metrics.tensor_metrics(ref, out), metrics.tensor_metrics(ref * scale, out * scale)
    assert extreme.sqnr_db == pytest.approx(plain.sqnr_db, rel=1e-9)
    assert extreme.cosine == pytest.approx(plain.cosine, rel=1e-9)


def test_perplexity_ratio_of_huge_logits_is_taken_in_log_space():
    # Logits of 1e30 put -log p(next) near 1e30: both perplexities are inf, but the models agree, and
    # the ratio is exp(difference of the mean log-likelihoods), not inf / inf.
    ids = np.array([[0, 1, 0, 1]])
    logits = np.zeros((1, 4, 2), np.float32)
    logits[..., 0] = 1e30  # every position predicts token 0; half the next tokens are 1
    figures = metrics.causal_lm_figures(logits, logits, ids)
    assert figures["perplexity_float"] == figures["perplexity_quantized"] == float("inf")
    assert figures["perplexity_ratio"] == 1.0
    worse = logits.copy()
    worse[..., 0] = 2e30
    assert metrics.causal_lm_figures(logits, worse, ids)["perplexity_ratio"] == float("inf")
    assert metrics.perplexity(logits, ids) == float("inf")


def test_sqnr_of_huge_or_non_finite_outputs_is_a_number_not_a_crash():
    from qconvert.verify.metrics import sqnr_db

    ref = np.array([1e38, -1e38], np.float32)
    test = np.array([1e38 * (1 + 1e-3), -1e38], np.float32)
    # By hand: signal 2e76, noise (1e35)^2 = 1e70: 10 log10(2e6) = 63.0103 dB.
    assert sqnr_db(ref, test) == pytest.approx(10 * math.log10(2e6), abs=1e-3)
    # A quantized output that overflowed float32 (what a 1e38 weight does) used to be log10(0): a crash.
    assert sqnr_db(np.array([1.0, 2.0]), np.array([1.0, np.inf])) == -math.inf
    assert sqnr_db(np.array([1.0, np.inf]), np.array([1.0, 2.0])) == -math.inf
    # By hand: 10 log10(1e-60 / 9e76) = -1369.54 dB (a number, however bad).
    assert sqnr_db(np.array([1e-30, 0.0]), np.array([3e38, 0.0])) == pytest.approx(-1369.5424, abs=1e-3)
