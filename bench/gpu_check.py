"""int4 (W4A16, with and without zero points) and FP8 kernels on a GPU against their pure-jnp references, at real
shapes.

    python bench/gpu_check.py          # on a machine where jax sees a GPU

The GPU suite (../shared/gpu/check.py) covers int8, W8A16, NF4 and the grouped kernels; this covers the other
two dense kernels the same way: each case runs the kernel with backend="gpu" and the reference on the same
device and prints the plan and the largest error relative to the largest output. int4 passes within 2e-2
(bf16 weights and activations, float32 sums); FP8 within 3e-4 (its products are exact; on an H200 its fp8 MMA
summed within 2.1e-4, docs/BENCHMARKS.md). A fallback to the reference counts as a failure. Exit 1 on any.
"""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from qconvert import kernels as K

SHAPES = [(1, 4096, 4096), (7, 576, 1536), (128, 1536, 576), (512, 4096, 14336), (4096, 4096, 4096),
          (1, 14336, 4096)]


def case(name, kernel, reference, rtol, fails):
    try:
        y, plan = kernel()
        y = np.asarray(jax.block_until_ready(y), np.float32)
        r = np.asarray(reference(), np.float32)
        rel = float(np.abs(y - r).max()) / (float(np.abs(r).max()) + 1e-30)
        ok = rel <= rtol and not plan.is_reference
        print(f"{'OK  ' if ok else 'FAIL'} {name:40s} plan={plan.name}/{plan.backend} rel={rel:.2g}", flush=True)
    except Exception as e:  # a kernel that does not compile is a failure to report, not to stop at
        print(f"ERR  {name}: {type(e).__name__}: {str(e)[:600]}", flush=True)
        traceback.print_exc(limit=4)
        ok = False
    if not ok:
        fails.append(name)


def main() -> int:
    print("jax", jax.__version__, jax.devices(), flush=True)
    rng = np.random.default_rng(1)
    fails: list[str] = []
    for m, k, n in SHAPES:
        x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(jnp.bfloat16)
        codes = jnp.asarray(rng.integers(-8, 8, (n, k)).astype(np.int8))
        for g in (128, 64, None):
            if g is not None and k % g:
                continue  # the kernel refuses a K that is not whole groups (KernelArgumentError)
            s = jnp.asarray(rng.uniform(1e-3, 1e-2, (n, k // g) if g else (n,)).astype(np.float32))
            case(f"int4 M={m} K={k} N={n} group={g}",
                 lambda: K.int4_weight_matmul(x, codes, s, group_size=g, out_dtype=jnp.float32, backend="gpu",
                                              return_plan=True),
                 lambda: K.int4_weight_matmul_reference(x, codes, s, group_size=g, out_dtype=jnp.float32), 2e-2, fails)
            z = jnp.asarray(rng.integers(-8, 8, s.shape).astype(np.int8))  # int4-asym: (code - zero) * scale
            case(f"int4 zero points M={m} K={k} N={n} group={g}",
                 lambda: K.int4_weight_matmul(x, codes, s, group_size=g, out_dtype=jnp.float32, backend="gpu",
                                              return_plan=True, w_zero=z),
                 lambda: K.int4_weight_matmul_reference(x, codes, s, group_size=g, out_dtype=jnp.float32, w_zero=z),
                 2e-2, fails)
        x_q, x_s = K.quantize_fp8_activations(x)
        w_q = jnp.asarray(rng.normal(size=(n, k)).astype(np.float32) * 50).astype(jnp.float8_e4m3fn)
        w_s = jnp.asarray(rng.uniform(1e-3, 1e-2, n).astype(np.float32))
        case(f"fp8 M={m} K={k} N={n}",
             lambda: K.fp8_matmul(x_q, w_q, x_s, w_s, out_dtype=jnp.float32, backend="gpu", return_plan=True),
             lambda: K.fp8_matmul_reference(x_q, w_q, x_s, w_s, out_dtype=jnp.float32), 3e-4, fails)
    print("FAILURES:", len(fails), fails)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
