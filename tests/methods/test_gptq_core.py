"""GPTQ against the paper's algorithm written plainly in float64 numpy: the same codes in float64, the same
output error in float32, and a smaller error than round-to-nearest on held-out inputs, for every scheme."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from linear_inputs import linear
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.qarray import NF4_LEVELS
from qconvert.methods.gptq_core import gptq_codes, output_error
from qconvert.schemes import scheme_named


def reference_gptq(w, h, steps, round_values, damp=0.01, block=128, act_order=False):
    """Frantar et al. (2022), Algorithm 1 with lazy batch updates, in float64 numpy.

    round_values(x) maps x (in units of the step) to the nearest grid value. Returns the grid values.
    """
    w, h, steps = w.astype(np.float64).copy(), h.astype(np.float64).copy(), steps.astype(np.float64).copy()
    n = h.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    w, h, steps = w[:, perm], h[perm][:, perm], steps[:, perm]
    h[np.arange(n), np.arange(n)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.inv(h)
    u = np.linalg.cholesky(hinv).T  # upper: U^T U = H^-1
    values = np.zeros_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1 = w[:, i1:i2].copy()
        err1 = np.zeros_like(w1)
        for i in range(i2 - i1):
            x = w1[:, i]
            v = round_values(x / steps[:, i1 + i])
            values[:, i1 + i] = v
            err = (x - v * steps[:, i1 + i]) / u[i1 + i, i1 + i]
            w1[:, i:] -= np.outer(err, u[i1 + i, i1 + i:i2])
            err1[:, i] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    out = np.empty_like(values)
    out[:, perm] = values
    return out


def int_round(qmin, qmax):
    return lambda x: np.clip(np.round(x), qmin, qmax)


def nf4_round(x):
    levels = NF4_LEVELS.astype(np.float64)
    mid = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]).astype(np.float32) / np.float32(2)
    return levels[np.sum(x[:, None] > mid.astype(np.float64)[None, :], axis=1)]


SCHEMES = [("int4", LayoutFlags(group_size=128), int_round(-8, 7)),
           ("int4", LayoutFlags(group_size=64), int_round(-8, 7)),
           ("int8", LayoutFlags(), int_round(-127, 127)),
           ("nf4", LayoutFlags(), nf4_round)]
SHAPES = [(576, 1536), (1536, 576)]


def steps_of(scheme, w, flags):
    q = scheme.quantize(w, flags, scale_dtype=np.float32)
    return q, np.asarray(scheme.gptq_steps(q, flags), np.float64)


CODE_CASES = [(*scheme, False) for scheme in SCHEMES] + [(*SCHEMES[0], True)]


@pytest.mark.parametrize("name,flags,rounding,act_order", CODE_CASES,
                         ids=["int4-g128", "int4-g64", "int8", "nf4", "int4-g128-act-order"])
def test_codes_match_float64_reference(name, flags, rounding, act_order):
    rng = np.random.default_rng(0)
    w, x, _ = linear(rng, 64, 1536)  # a slice of rows of a real-width linear keeps float64 fast
    scheme = scheme_named(name)
    _, steps = steps_of(scheme, w, flags)
    h = 2 * x.astype(np.float64).T @ x / x.shape[0]
    expected = reference_gptq(w, h, steps, rounding, act_order=act_order)
    with jax.enable_x64(True):
        codes = np.asarray(gptq_codes(w.astype(np.float64), h, steps, 0.01, grid=scheme.gptq_grid(),
                                      act_order=act_order))
    got = _values(name, codes)
    assert np.mean(got == expected) > 0.999  # float64 ties aside, the same codes
    np.testing.assert_allclose(_err(w, got * steps, h), _err(w, expected * steps, h), rtol=1e-6)


def _values(name, codes):
    return NF4_LEVELS.astype(np.float64)[codes.astype(int)] if name == "nf4" else codes.astype(np.float64)


def _err(w, q, h):
    d = w.astype(np.float64) - q
    return float(np.sum((d @ h) * d))


# [out, in] of real linears (SmolLM-135M's up and down projections); 576 columns take no group of 128.
HELD_OUT_CASES = [(shape, *scheme) for shape in SHAPES for scheme in SCHEMES + [("fp8", LayoutFlags(), None)]
                  if not (scheme[1].group_size and shape[1] % scheme[1].group_size)]


@pytest.mark.parametrize("shape,name,flags,rounding", HELD_OUT_CASES,
                         ids=[f"{s[0]}x{s[1]}-{n}{'-g' + str(f.group_size) if f.group_size else ''}"
                              for s, n, f, _ in HELD_OUT_CASES])
def test_float32_gptq_beats_round_to_nearest_on_held_out_rows(shape, name, flags, rounding):
    rng = np.random.default_rng(1)
    out_f, in_f = shape
    w, x, held_out = linear(rng, out_f, in_f)
    scheme = scheme_named(name)
    q, steps = steps_of(scheme, w, flags)
    h = 2 * x.T @ x / x.shape[0]
    codes = np.asarray(gptq_codes(w, h, steps.astype(np.float32), 0.01, grid=scheme.gptq_grid()))
    gptq_w = _values(name, codes) * steps
    rtn_w = np.asarray(q.dequantize(np.float32), np.float64)
    h_held = held_out.astype(np.float64).T @ held_out

    assert _err(w, gptq_w, h_held) < 0.9 * _err(w, rtn_w, h_held)
    # qconvert.json's error: tr(D H D^T) / tr(W H W^T) on the calibration inputs
    h64 = x.astype(np.float64).T @ x
    relative = float(output_error(w, gptq_w.astype(np.float32), h))
    assert relative == pytest.approx(_err(w, gptq_w, h64) / _err(w, 0 * w, h64), rel=1e-4)


def sink_windows(rng, mix, sink, windows, seqlen=32):
    """Calibration-like windows [windows, seqlen, in] whose first token is an attention sink, nearly the same vector
    in every window with one channel near a thousand (a trained LLM's window start: SmolLM2-135M's reach 3,500);
    the other tokens correlated normals."""
    x = rng.standard_normal((windows, seqlen, mix.shape[0])) @ mix
    x[:, 0] = sink + 0.1 * rng.standard_normal((windows, mix.shape[0]))
    return x


def test_gptq_hessian_leaves_out_the_window_start_that_made_gptq_lose_to_round_to_nearest():
    from qconvert.calibration.statistics import hessian_sum

    rng = np.random.default_rng(3)
    out_f, in_f = 32, 192
    w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
    mix = rng.standard_normal((in_f, in_f)) / np.sqrt(in_f) + np.eye(in_f)
    sink = rng.standard_normal(in_f)
    sink[7] = 1000.0
    calibration, held_out = sink_windows(rng, mix, sink, 48), sink_windows(rng, mix, sink, 48)
    scheme, flags = scheme_named("int4"), LayoutFlags(group_size=64)
    q, steps = steps_of(scheme, w, flags)
    rtn = np.asarray(q.dequantize(np.float32), np.float64)
    rest = held_out[:, 1:].reshape(-1, in_f)
    rest_h = rest.T @ rest  # the held-out tokens that are not window starts

    # The cause, in the plain float64 algorithm: on every token's Hessian (the sink's rows hold most of it),
    # GPTQ fits the window starts and the other tokens' output error exceeds round-to-nearest's.
    every = calibration.reshape(-1, in_f)
    before = reference_gptq(w, 2 * every.T @ every / len(every), steps, int_round(-8, 7), damp=0.1) * steps
    assert _err(w, before, rest_h) > 1.5 * _err(w, rtn, rest_h)

    # The Hessian calibration builds now: 2 X^T X / n over the tokens past each window's start.
    total, count = hessian_sum(calibration.astype(np.float32), np.ones(calibration.shape[:2], bool))
    past_start = calibration[:, 1:].reshape(-1, in_f)
    assert int(count) == len(past_start)
    h = 2 * np.asarray(total, np.float64) / int(count)
    np.testing.assert_allclose(h, 2 * past_start.T @ past_start / len(past_start), rtol=1e-4,
                               atol=1e-5 * np.abs(h).max())
    codes = np.asarray(gptq_codes(w, h.astype(np.float32), steps.astype(np.float32), 0.1, grid=scheme.gptq_grid()))
    after = codes.astype(np.float64) * steps
    np.testing.assert_array_equal(codes, reference_gptq(w, h, steps, int_round(-8, 7), damp=0.1))
    assert _err(w, after, rest_h) < 0.75 * _err(w, rtn, rest_h)
