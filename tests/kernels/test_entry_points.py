"""The entry points' own work happens once: at trace time under jax.jit, once per shape when eager."""

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.kernels import dense, int8_matmul, nf4_matmul
from qconvert.kernels import plan as plan_module

RNG = np.random.default_rng(3)


def test_under_jit_checks_planning_and_padding_run_at_trace_time_only(monkeypatch):
    calls = []
    check = dense.check_int8_matmul
    monkeypatch.setattr(dense, "check_int8_matmul", lambda *a: calls.append(1) or check(*a))
    x_q = RNG.integers(-127, 128, (5, 200)).astype(np.int8)  # K and N off the tiles: padding is needed
    w_q = RNG.integers(-127, 128, (130, 200)).astype(np.int8)
    x_scale, w_scale = np.full(5, 0.01, np.float32), np.full(130, 0.02, np.float32)
    forward = jax.jit(lambda a, b, c, d: int8_matmul(a, b, c, d, backend="cpu"))
    for _ in range(3):
        y = forward(x_q, w_q, x_scale, w_scale)
    assert len(calls) == 1
    expected = (x_q.astype(np.int64) @ w_q.astype(np.int64).T).astype(np.float32) * np.float32(0.01)
    np.testing.assert_array_equal(np.asarray(y), expected * np.float32(0.02))
    # the compiled program is the kernel plus its layout: one pallas_call, no host callback per check
    jaxpr = str(jax.make_jaxpr(lambda a, b, c, d: int8_matmul(a, b, c, d, backend="tpu"))(
        x_q, w_q, x_scale, w_scale))
    assert jaxpr.count("pallas_call") == 1 and "callback" not in jaxpr


def test_eager_calls_of_one_shape_plan_once():
    packed = RNG.integers(0, 256, 128 * 256 // 2).astype(np.uint8)
    absmax = RNG.uniform(0.1, 1.0, 128 * 256 // 64).astype(np.float32)
    x = jnp.asarray(RNG.normal(size=(3, 256)).astype(np.float32))
    plan_module._select_kernel.cache_clear()
    plans = [nf4_matmul(x, packed, absmax, shape=(128, 256), backend="cpu", return_plan=True)[1] for _ in range(3)]
    info = plan_module._select_kernel.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    assert plans[0] is plans[1] is plans[2] and plans[0].tile_table == "tpu/decode"
