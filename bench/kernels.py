"""Time the quantized matmul kernels beside the XLA bf16 matmul on the dequantized weight.

    python bench/kernels.py            # M in {1, 16, 512, 4096}, (K, N) in {(4096, 4096), (4096, 14336)}
    python bench/kernels.py --quick    # small shapes, for a CPU (interpret mode) run in a minute or two
    python bench/kernels.py --m 1 16 --kn 1024x1024 --backend cpu

Each line: kernel plan, kernel time, XLA baseline time, baseline/kernel ratio
(> 1 means the kernel is faster), and the kernel's TFLOP/s. On CPU the Pallas
kernels run in TPU interpret mode: those times check the plumbing, they are not
performance figures.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.kernels import int8_matmul, int8_weight_matmul, nf4_matmul, quantize_activations, resolve_backend


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() in seconds, after one warm-up call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def operands(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(jnp.bfloat16)
    w_q = jnp.asarray(rng.integers(-127, 128, (n, k)).astype(np.int8))
    w_scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n).astype(np.float32))
    codes = rng.integers(0, 16, n * k)
    packed = jnp.asarray(((codes[0::2] << 4) | codes[1::2]).astype(np.uint8))
    absmax = jnp.asarray(rng.uniform(0.1, 1.0, n * k // 64).astype(np.float32))
    return x, w_q, w_scale, packed, absmax


def bench_shape(m: int, k: int, n: int, backend: str, repeats: int) -> list[str]:
    x, w_q, w_scale, packed, absmax = operands(m, k, n)
    w_bf16 = (w_q.astype(jnp.float32) * w_scale[:, None]).astype(jnp.bfloat16)
    baseline_fn = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    baseline = timed(lambda: baseline_fn(x, w_bf16), repeats)
    x_q, x_scale = quantize_activations(x)
    cases = {
        "int8_matmul": lambda **kw: int8_matmul(x_q, w_q, x_scale, w_scale, out_dtype=jnp.bfloat16, **kw),
        "int8_weight_matmul": lambda **kw: int8_weight_matmul(x, w_q, w_scale, out_dtype=jnp.bfloat16, **kw),
        "nf4_matmul": lambda **kw: nf4_matmul(x, packed, absmax, shape=(n, k), out_dtype=jnp.bfloat16, **kw),
    }
    lines = []
    flops = 2.0 * m * k * n
    for name, run in cases.items():
        _, plan = run(backend=backend, return_plan=True)
        seconds = timed(lambda: run(backend=backend), repeats)
        lines.append(f"| {name} | {m} | {k}x{n} | {plan.describe()} | {seconds * 1e3:.3f} | {baseline * 1e3:.3f} | "
                     f"{baseline / seconds:.2f} | {flops / seconds / 1e12:.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU interpret mode)")
    parser.add_argument("--m", type=int, nargs="*", help="row counts M")
    parser.add_argument("--kn", nargs="*", help="KxN pairs, e.g. 4096x14336")
    parser.add_argument("--backend", default="auto", help="auto, tpu, gpu, cpu or reference")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ms = args.m or ([1, 16] if args.quick else [1, 16, 512, 4096])
    kns = [tuple(int(v) for v in kn.split("x")) for kn in args.kn] if args.kn else (
        [(512, 512), (1024, 1024)] if args.quick else [(4096, 4096), (4096, 14336)])
    device = jax.devices()[0]
    print(f"# device: {device.platform} {device.device_kind}; host: {platform.processor() or platform.machine()}; "
          f"jax {jax.__version__}; backend {resolve_backend(args.backend)}")
    print("| kernel | M | KxN | plan | kernel ms | XLA bf16 ms | XLA/kernel | kernel TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for k, n in kns:
        for m in ms:
            for line in bench_shape(m, k, n, args.backend, args.repeats):
                print(line, flush=True)


if __name__ == "__main__":
    main()
