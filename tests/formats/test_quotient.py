"""formats.quotient.f32_quotient is the IEEE float32 quotient, with float64 on or off; the int8 row quantizer's values."""

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.quotient import f32_quotient, int8_round
from qconvert.kernels.activations import fake_quantize_rows


def _hard_quotients(rows=4096):
    # Numerators and divisors of every magnitude, plus the divisor 127 that scales use.
    rng = np.random.default_rng(7)
    a = (rng.standard_normal(rows) * np.exp2(rng.integers(-20, 20, rows))).astype(np.float32)
    d = np.abs(rng.standard_normal(rows) * np.exp2(rng.integers(-20, 20, rows))).astype(np.float32) + np.float32(1e-30)
    return a, d


def test_f32_quotient_is_numpy_float32_division_without_float64():
    a, d = _hard_quotients()
    want = a / d  # numpy float32 division: IEEE, correctly rounded
    got = np.asarray(jax.jit(f32_quotient)(a, d))
    np.testing.assert_array_equal(got, want)
    # A broadcast constant divisor is where XLA would multiply by the reciprocal instead.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: f32_quotient(x, np.float32(127)))(a)),
                                  a / np.float32(127))


def test_f32_quotient_is_numpy_float32_division_with_float64():
    a, d = _hard_quotients()
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(f32_quotient)(jnp.asarray(a), jnp.asarray(d)))
        by_127 = np.asarray(jax.jit(lambda x: f32_quotient(x, jnp.float32(127)))(jnp.asarray(a)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, a / d)
    np.testing.assert_array_equal(by_127, a / np.float32(127))


def test_fake_quantize_rows_is_the_int8_row_quantizer_hand_worked():
    # Row 0: absmax 2.54 -> scale 0.02; 1.27 / 0.02 = 63.5 rounds to even 64. Row 1 is zeros.
    x = np.array([[2.54, -1.27, 0.01], [0.0, 0.0, 0.0]], np.float32)
    scale = np.float32(2.54) / np.float32(127)
    codes = np.round(x[0] / scale)
    want = np.stack([codes * scale, np.zeros(3, np.float32)])
    np.testing.assert_array_equal(np.asarray(fake_quantize_rows(x)), want)
    # Static: one scale for the tensor, codes clamped to [-127, 127].
    static = np.asarray(fake_quantize_rows(x, np.float32(0.01)))
    np.testing.assert_array_equal(static[0], np.float32([127, -127, 1]) * np.float32(0.01))


def test_int8_round_is_numpy_clip_round_of_the_float32_quotient_where_the_searches_call_it():
    # The searches round per candidate inside lax.map, under jit, with float64 off;
    # the weight quantizer rounds with float64 on. Both must give numpy's codes.
    # x sits one ulp off the rounding midpoints (k + 0.5) * s, where x * (1 / s),
    # XLA's rewrite of a plain x / s, picks the wrong code thousands of times.
    rng = np.random.default_rng(11)
    s = (np.abs(rng.standard_normal((64, 1))) * 0.01 + 1e-3).astype(np.float32)
    x = ((rng.integers(-127, 127, (64, 576)) + np.float32(0.5)) * s).astype(np.float32)
    x = np.where(rng.random(x.shape) < 0.5, np.nextafter(x, np.inf), np.nextafter(x, -np.inf)).astype(np.float32)
    scales = np.stack([s, s * np.float32(0.9)]).astype(np.float32)
    want = np.clip(np.rint(x[None] / scales), -127, 127)  # numpy: the IEEE quotient, rounded half to even
    searched = jax.jit(lambda x, s: jax.lax.map(lambda one: int8_round(x, one), s))(x, scales)
    np.testing.assert_array_equal(np.asarray(searched), want)
    np.testing.assert_array_equal(np.asarray(jax.vmap(int8_round, in_axes=(None, 0))(x, scales)), want)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(np.asarray(jax.jit(int8_round)(jnp.asarray(x), jnp.asarray(s))), want[0])
