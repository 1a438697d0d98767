"""GPTQ on int4-asym's grid (codes round(w / s) + z, clipped to [-8, 7], the weight (code - z) * s) against the
paper's algorithm written plainly in float64 numpy with each weight's zero point, and better than
round-to-nearest on held-out inputs; scales and zero points stay round-to-nearest's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qconvert.formats.layout_base import LayoutFlags
from qconvert.methods.gptq_core import gptq_codes
from qconvert.schemes import scheme_named

from linear_inputs import linear


def reference_asym_gptq(w, h, steps, zeros, damp=0.01, block=128, act_order=False):
    """Frantar et al. (2022), Algorithm 1 with lazy batch updates, in float64 numpy, each column rounded to
    clip(round(x / s) + z, -8, 7). Returns the codes."""
    w, h = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    steps, zeros = steps.astype(np.float64), zeros.astype(np.float64)
    n = h.shape[0]
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(n)
    w, h, steps, zeros = w[:, perm], h[perm][:, perm], steps[:, perm], zeros[:, perm]
    h[np.arange(n), np.arange(n)] += damp * np.mean(np.diag(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    codes = np.zeros_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1 = w[:, i1:i2].copy()
        err1 = np.zeros_like(w1)
        for i in range(i2 - i1):
            j = i1 + i
            x = w1[:, i]
            codes[:, j] = np.clip(np.round(x / steps[:, j]) + zeros[:, j], -8, 7)
            err = (x - (codes[:, j] - zeros[:, j]) * steps[:, j]) / u[j, j]
            w1[:, i:] -= np.outer(err, u[j, j:i2])
            err1[:, i] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    out = np.empty_like(codes)
    out[:, perm] = codes
    return out


def _err(w, q, h):
    d = w.astype(np.float64) - q
    return float(np.sum((d @ h) * d))


@pytest.mark.parametrize("group, act_order", [(128, False), (64, True)])
def test_codes_match_the_float64_reference_with_zero_points(group, act_order):
    rng = np.random.default_rng(0)
    w, x, _ = linear(rng, 32, 768)  # a slice of rows of a real-width linear keeps float64 fast
    w += 0.01  # off-centre rows: the zero points are not all 0
    scheme, flags = scheme_named("int4-asym"), LayoutFlags(group_size=group)
    q = scheme.quantize(w, flags, scale_dtype=np.float32)
    steps = np.asarray(scheme.gptq_steps(q, flags), np.float64)
    zeros = np.asarray(scheme.gptq_offsets(q, flags), np.float64)
    assert np.abs(zeros).max() > 0
    h = 2 * x.astype(np.float64).T @ x / x.shape[0]
    expected = reference_asym_gptq(w, h, steps, zeros, act_order=act_order)
    with jax.enable_x64(True):
        codes = np.asarray(gptq_codes(w.astype(np.float64), h, steps, 0.01, grid=scheme.gptq_grid(),
                                      act_order=act_order, offsets=zeros))
    assert np.mean(codes == expected) > 0.999  # float64 ties aside, the same codes
    assert codes.min() >= -8 and codes.max() <= 7


def test_float32_gptq_on_the_asymmetric_grid_beats_round_to_nearest_on_held_out_rows():
    rng = np.random.default_rng(1)
    w, x, held_out = linear(rng, 576, 1536)
    scheme, flags = scheme_named("int4-asym"), LayoutFlags(group_size=128)
    q = scheme.quantize(w, flags, scale_dtype=np.float32)
    steps = scheme.gptq_steps(q, flags)
    zeros = scheme.gptq_offsets(q, flags)
    h = 2 * x.T @ x / x.shape[0]
    codes = np.asarray(gptq_codes(w, h, steps, 0.01, grid=scheme.gptq_grid(), offsets=zeros))
    chosen = scheme.gptq_qarray(q, codes)
    np.testing.assert_array_equal(chosen.zero_point, q.zero_point)  # the layout's scales and zero points stay
    gptq_w = np.asarray(chosen.dequantize(np.float32), np.float64)
    rtn_w = np.asarray(q.dequantize(np.float32), np.float64)
    h_held = held_out.astype(np.float64).T @ held_out
    assert _err(w, gptq_w, h_held) < 0.9 * _err(w, rtn_w, h_held)
