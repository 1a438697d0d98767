"""Every kernel at the contraction sizes of real models, on every backend that runs on CPU, against
independent float64 numpy products: the TPU kernels in TPU interpret mode (backend "cpu") and the
Triton kernels in Pallas' generic interpreter (backend "gpu").

Bugs of this kind live in K (a K tile the kernel walks wrongly), so K is swept
and M and N are kept small: M in {1, odd, larger than a row tile}, N a multiple
of the column tile or not. Each kernel and backend runs K = 576, 768 and 4864
(K tiles that are odd multiples of 256, or long) and its share of the rest of
SWEEP_KS, dealt out so that every K of the sweep runs on some kernel. The plan
must pick the kernel: a fallback to the reference fails the test.
"""

import itertools

import numpy as np
import jax.numpy as jnp
import pytest

from qconvert.formats import NF4_LEVELS, QArray
from qconvert.kernels import grouped_matmul, int8_matmul, int8_weight_matmul, nf4_matmul

# Every multiple of 64 up to 2048, and the hidden and intermediate sizes of popular open models.
SWEEP_KS = sorted(set(range(64, 2049, 64)) | {384, 576, 768, 896, 960, 1536, 2048, 2560, 3072, 3584, 4096, 4864,
                                               5120, 8192, 11008, 14336, 18944})
ALWAYS_KS = (576, 768, 4864)
KERNELS = ("int8_matmul", "int8_weight_matmul", "nf4_matmul", "grouped_float", "grouped_int8", "grouped_nf4")
BACKENDS = ("cpu", "gpu")
# M: one row, an odd count, and more rows than the largest row tile (256 TPU, 128 GPU); N: a multiple of
# the column tile, or not.
M_CHOICES = (1, 7, 261)
N_CHOICES = (128, 200)


def sweep_cases():
    """(kernel, backend, m, k, n) cases: ALWAYS_KS on every pair, the other Ks dealt round-robin."""
    pairs = list(itertools.product(KERNELS, BACKENDS))
    rest = [k for k in SWEEP_KS if k not in ALWAYS_KS]
    ks = {pair: list(ALWAYS_KS) for pair in pairs}
    for i, k in enumerate(rest):
        ks[pairs[(i * 5) % len(pairs)]].append(k)
    cases = []
    for p, pair in enumerate(pairs):
        for j, k in enumerate(ks[pair]):
            # a large M only at moderate K, to keep the interpreted grids short
            m = M_CHOICES[(p + j) % 3] if k <= 4096 else M_CHOICES[(p + j) % 2]
            cases.append(pytest.param(*pair, m, k, N_CHOICES[(p + 2 * j) % 2], id=f"{pair[0]}-{pair[1]}-m{m}-k{k}"))
    return cases


def int8_codes(rng, *shape):
    return rng.integers(-127, 128, shape).astype(np.int8)


def nf4_codes(rng, n, k):
    """Packed NF4 codes (high nibble first), absmax per 64-block, and the float64 weight [n, k] they mean."""
    codes = rng.integers(0, 16, n * k)
    packed = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8)
    absmax = rng.uniform(0.05, 2.0, n * k // 64).astype(np.float32)
    return packed, absmax, (NF4_LEVELS[codes].astype(np.float64) * np.repeat(absmax, 64)).reshape(n, k)


def group_sizes(m):
    """Three experts: the middle one empty, and (for m > 2) one row past the groups."""
    first = m // 2
    return np.array([first, 0, m - first - (1 if m > 2 else 0)], np.int32)


def grouped_expected(x, weights, sizes):
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    out = np.zeros((x.shape[0], weights[0].shape[0]))
    for g, w in enumerate(weights):
        out[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]].astype(np.float64) @ w.T
    return out


def run_case(kernel, backend, m, k, n, rng):
    """(y, plan, float64 expected) for one case."""
    x = rng.normal(size=(m, k)).astype(np.float32)
    if kernel == "int8_matmul":
        x_q, w_q = int8_codes(rng, m, k), int8_codes(rng, n, k)
        x_scale = rng.uniform(1e-3, 0.1, m).astype(np.float32)
        w_scale = rng.uniform(1e-3, 0.1, n).astype(np.float32)
        y, plan = int8_matmul(x_q, w_q, x_scale, w_scale, backend=backend, return_plan=True)
        # the documented rescale on an exact integer sum: bit-exact
        acc = (x_q.astype(np.int64) @ w_q.astype(np.int64).T).astype(np.float32)
        return y, plan, acc * x_scale[:, None] * w_scale[None, :]
    if kernel == "int8_weight_matmul":
        w_q, w_scale = int8_codes(rng, n, k), rng.uniform(1e-3, 0.1, n).astype(np.float32)
        y, plan = int8_weight_matmul(x, w_q, w_scale, backend=backend, return_plan=True)
        return y, plan, x.astype(np.float64) @ (w_q.astype(np.float64) * w_scale[:, None]).T
    if kernel == "nf4_matmul":
        packed, absmax, weight = nf4_codes(rng, n, k)
        y, plan = nf4_matmul(x, packed, absmax, shape=(n, k), backend=backend, return_plan=True)
        return y, plan, x.astype(np.float64) @ weight.T
    sizes = group_sizes(m)
    if kernel == "grouped_float":
        rhs = rng.normal(size=(3, k, n)).astype(np.float32)
        y, plan = grouped_matmul(x, rhs, jnp.asarray(sizes), backend=backend, return_plan=True)
        return y, plan, grouped_expected(x, [w.T.astype(np.float64) for w in rhs], sizes)
    if kernel == "grouped_int8":
        codes, scale = int8_codes(rng, 3, n, k), rng.uniform(1e-3, 0.1, (3, n)).astype(np.float32)
        y, plan = grouped_matmul(x, codes, jnp.asarray(sizes), rhs_scale=scale, transpose_rhs=True, backend=backend,
                                 return_plan=True)
        return y, plan, grouped_expected(x, [codes[g].astype(np.float64) * scale[g][:, None] for g in range(3)],
                                         sizes)
    experts = [nf4_codes(rng, n, k) for _ in range(3)]
    q = QArray(np.concatenate([e[0] for e in experts]), np.concatenate([e[1] for e in experts]), kind="nf4",
               block_size=64, shape=(3, n, k), dtype="float32")
    y, plan = grouped_matmul(x, q, jnp.asarray(sizes), transpose_rhs=True, backend=backend, return_plan=True)
    return y, plan, grouped_expected(x, [e[2] for e in experts], sizes)


@pytest.mark.parametrize("kernel,backend,m,k,n", sweep_cases())
def test_kernel_matches_float64_product_at_real_model_sizes(kernel, backend, m, k, n, request):
    if backend == "gpu":
        request.getfixturevalue("triton_interpreted")
    rng = np.random.default_rng(k * 7919 + m * 31 + n)
    y, plan, expected = run_case(kernel, backend, m, k, n, rng)
    assert plan.fallback_reason is None and not plan.is_reference, plan.describe()
    assert plan.backend == backend
    y = np.asarray(y)
    assert y.shape == expected.shape
    if kernel == "int8_matmul":
        np.testing.assert_array_equal(y, expected)
    else:
        # float32 accumulation over K terms; a dropped or repeated K chunk is off by tens of percent
        scale = np.abs(expected).max()
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5 * np.sqrt(k) * scale / 10 + 1e-6)


def test_sweep_covers_every_k_and_the_odd_multiples_of_256_on_every_kernel():
    cases = [p.values for p in sweep_cases()]
    assert {c[3] for c in cases} == set(SWEEP_KS)
    for kernel, backend in itertools.product(KERNELS, BACKENDS):
        ks = {c[3] for c in cases if c[:2] == (kernel, backend)}
        assert set(ALWAYS_KS) <= ks
    assert {c[2] for c in cases} == set(M_CHOICES) and {c[4] for c in cases} == set(N_CHOICES)
