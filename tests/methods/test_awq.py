"""AWQ's search against a plain float64 numpy AWQ written here (act_mean, w_mean per quantization group, the
duo-scaling grid, the output error with round-to-nearest int4), on linears of SmolLM2's MLP shapes with outlier
input channels: the same candidate and scales, the same error, and a held-out output error below plain rounding's."""

import json

import numpy as np
import pytest

from qconvert.formats.layout_base import LayoutFlags
from qconvert.methods.awq import GroupInputs, candidate_scales, Candidate, search_group
from qconvert.models.family import SmoothingGroup
from qconvert.schemes import scheme_named

OUTLIERS = (5, 77, 300)


def rows(n: int, width: int, seed: int) -> np.ndarray:
    """Activations with a few channels 20-40x larger than the rest, as trained LLMs' norm outputs have."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, width))
    x[:, list(OUTLIERS)] *= np.array([20.0, 30.0, 40.0])
    return x.astype(np.float32)


def int4_rtn(w: np.ndarray, group: int) -> np.ndarray:
    """Symmetric int4 round-to-nearest per row and group (compressed-tensors'): scale absmax / 7.5 and the
    quotient in float32, as torch takes them (the group's absmax lands on +-7.5, a tie float32 decides), codes
    round half to even into [-8, 7]; dequantized in float64."""
    g = w.astype(np.float32).reshape(w.shape[0], -1, group)
    scale = np.abs(g).max(axis=2, keepdims=True) / np.float32(7.5)
    codes = np.clip(np.round(g / scale), -8, 7)
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(w.shape)


def numpy_awq(w: np.ndarray, x: np.ndarray, group: int):
    """The whole search in float64: (alpha, duo, s, error) of the first least-error candidate."""
    w, x = w.astype(np.float64), x.astype(np.float64)
    # The statistics and s are float32 where they are kept (the fold multiplies the float32 weight by a float32 s).
    act = np.abs(x).mean(axis=0).astype(np.float32).astype(np.float64)
    g = np.abs(w).reshape(-1, group)
    w_mean = (g / (g.max(axis=1, keepdims=True) + 1e-6)).reshape(w.shape).mean(axis=0)
    w_mean = w_mean.astype(np.float32).astype(np.float64)
    y = x @ w.T
    best = None
    for alpha in [k * 0.05 for k in range(20)]:
        for duo in (False, True):
            s = act ** alpha / (w_mean ** (1 - alpha) + 1e-4) if duo else act ** alpha
            s = np.maximum(s, 1e-4)
            s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
            scaled = w.astype(np.float32) * s
            s = s.astype(np.float64)
            error = np.mean(((x / s) @ int4_rtn(scaled, group).T - y) ** 2)
            if best is None or error < best[3]:
                best = (alpha, duo, s, error)
    return best


@pytest.mark.parametrize("out_features, in_features, group", [(1536, 576, 64), (576, 1536, 128)])
def test_awq_chooses_the_reference_scales_and_beats_rounding_on_held_out_rows(out_features, in_features, group):
    rng = np.random.default_rng(out_features + group)
    w = (rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)).astype(np.float32)
    x = rows(128, in_features, seed=1)
    scheme = scheme_named("int4")
    flags = LayoutFlags(group_size=group)
    linear = "mlp.up_proj"

    def quantize(weight, dtype):
        return np.asarray(scheme.quantize(weight, flags, scale_dtype=dtype).dequantize(np.float32))

    found, errors = search_group(SmoothingGroup("norm", (linear,)),
                                 GroupInputs({linear: w}, {linear: np.dtype(np.float32)}, {linear: x},
                                             np.abs(x.astype(np.float64)).mean(axis=0).astype(np.float32)),
                                 quantize, {linear: group})
    alpha, duo, s, error = numpy_awq(w, x, group)
    chosen = min(errors, key=errors.get)
    assert chosen == Candidate(alpha, duo).key and found.alpha == pytest.approx(alpha)
    assert alpha > 0  # the outliers make a real scaling win, not the identity
    np.testing.assert_array_equal(found.input_scales, s)
    assert errors[chosen] == pytest.approx(error, rel=1e-6)

    held_out = rows(256, in_features, seed=2).astype(np.float64)
    y = held_out @ w.astype(np.float64).T
    s64 = found.input_scales.astype(np.float64)
    awq = np.mean(((held_out / s64) @ int4_rtn(w.astype(np.float64) * s64, group).T - y) ** 2)
    rtn = np.mean((held_out @ int4_rtn(w.astype(np.float64), group).T - y) ** 2)
    assert awq < 0.9 * rtn


def test_candidate_scales_follow_llm_compressors_formula_and_normalisation():
    act = np.array([0.5, 2.0, 8.0], np.float32)
    w_mean = np.array([0.4, 0.2, 0.1], np.float32)
    duo = act ** 0.5 / (w_mean ** 0.5 + 1e-4)
    np.testing.assert_allclose(candidate_scales(act, w_mean, Candidate(0.5, True)),
                               duo / np.sqrt(duo.max() * duo.min()), rtol=1e-6)
    np.testing.assert_array_equal(candidate_scales(act, w_mean, Candidate(0.0, False)), np.ones(3, np.float32))


def test_the_observer_s_input_abs_mean_is_the_mean_over_every_token(tmp_path):
    """Few enough tokens that the kept rows are all of them: act_mean must be their mean |x|, in three batches."""
    from checkpoints import make_llama_checkpoint

    from qconvert.calibration.data import random_windows
    from qconvert.calibration.observer import iter_layer_stats, open_params
    from qconvert.calibration.statistics import InputAbsMax, InputAbsMean, KeptRows
    from qconvert.models import build

    folder = make_llama_checkpoint(tmp_path / "src", hidden=64, layers=1, heads=4, kv_heads=2, intermediate=96,
                                   vocab=128, outlier_channels=(3,))
    model, params = build(json.loads((folder / "config.json").read_text())), open_params(folder)
    keep = {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    stats = next(iter_layer_stats(model, params, random_windows(128, 5, 16, seed=0), batch_size=2, keep_inputs=keep))
    for m in keep:
        rows = stats.of(KeptRows)[m]
        assert rows.shape == (80, stats.of(InputAbsMax)[m].shape[0])
        np.testing.assert_allclose(stats.of(InputAbsMean)[m], np.abs(rows.astype(np.float64)).mean(axis=0), rtol=1e-6)
    assert set(stats.of(InputAbsMean)) == keep
