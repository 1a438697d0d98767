"""Per-layer time of the quantized matmul kernels as a forward pass runs them, beside XLA's own matmuls.

    python bench/kernels.py                  # M in {1, 16, 64, 512, 4096}, (K, N) in {(4096, 4096), (4096, 14336)}
    python bench/kernels.py --quick          # small shapes, for a CPU (interpret mode) run
    python bench/kernels.py --m 1 16 --kn 1024x1024 --layers 8 --backend cpu

Every method runs L layers of the same shape, each with its own weight
buffer, unrolled in one jit (bf16 in and out), as a forward pass runs its
layers; the time per layer is that call's time over L. No layer slices its
weight out of a stacked array: XLA's dot fuses such a slice, a Pallas call
cannot and would pay a copy per layer that a real model (one buffer per
weight) never pays. Beside each kernel run five XLA baselines on
the same weights: bf16 `dot`, XLA's own int8 dot_general (int32 accumulation;
activations quantized per token in both it and W8A8), XLA's own FP8 dot_general
(E4M3 x E4M3 with float32 accumulation; activations quantized per token to E4M3
in both it and fp8_matmul), an XLA NF4
dequantize-then-dot and an XLA int4 dequantize-then-dot (nibble-packed codes,
groups of 128). The int4 entry point takes the codes at their logical shape
and packs them inside its jitted launch, so its time includes that pass;
"W4A16 prepared" runs the same kernel on weights packed once beforehand
(kernels/prepared.py), as loading and verify do.
Ratios are baseline time / method time (> 1: the method is faster). The
memory-bound floor is the bytes a layer must read (weights in each
format plus activations) over the device's read bandwidth, measured here
(a jitted sum over 256 MiB).

Also printed: each entry point's eager per-call overhead, the time of an eager
call whose kernel is swapped for a no-op of the same output (checks, cached
plan, padding and one dispatch), next to the same call inside jax.jit.

On CPU the Pallas kernels run in TPU interpret mode, which simulates every grid
step: those times check the plumbing and are not performance figures.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats import NF4_LEVELS
from qconvert.kernels import (fp8_matmul, int4_weight_matmul, int8_matmul, int8_weight_matmul, nf4_matmul,
                              quantize_activations, quantize_fp8_activations, resolve_backend, select_kernel,
                              KernelProblem)
from qconvert.kernels import gpu_dense, tpu_dense
from qconvert.kernels.prepared import prepare_int4, prepared_matmul

BF16 = jnp.bfloat16
NT = (((1,), (1,)), ((), ()))
INT4_GROUP = 128


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() in seconds, after one warm-up call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def stacked_operands(layers: int, m: int, k: int, n: int, seed: int = 0) -> dict:
    """x [M, K] bf16 and every layer's weight in each format, stacked on a leading layer axis (for
    layer_buffers to split, and for entry_overheads to take one layer of)."""
    rng = np.random.default_rng(seed)
    w_q = rng.integers(-127, 128, (layers, n, k)).astype(np.int8)
    w_scale = rng.uniform(1e-3, 1e-2, (layers, n)).astype(np.float32)
    codes = rng.integers(0, 16, (layers, n * k))
    int4_q = rng.integers(-8, 8, (layers, n, k)).astype(np.int8)
    int4_u = int4_q.astype(np.int32) & 0xF
    return {
        "x": jnp.asarray(rng.normal(size=(m, k)).astype(np.float32)).astype(BF16),
        "w_bf16": jnp.asarray(w_q.astype(np.float32) * w_scale[:, :, None]).astype(BF16),
        "w_q": jnp.asarray(w_q), "w_scale": jnp.asarray(w_scale),
        # the same weights as E4M3 codes (the int8 codes' values scaled into [-448, 448])
        "w_f8": jnp.asarray(w_q.astype(np.float32) * (448 / 127)).astype(jnp.float8_e4m3fn),
        "f8_scale": jnp.asarray(w_scale * (127 / 448)),
        "packed": jnp.asarray(((codes[:, 0::2] << 4) | codes[:, 1::2]).astype(np.uint8)),
        "absmax": jnp.asarray(rng.uniform(0.1, 1.0, (layers, n * k // 64)).astype(np.float32)),
        "int4_q": jnp.asarray(int4_q),
        "int4_scale": jnp.asarray(rng.uniform(1e-3, 1e-2, (layers, n, k // INT4_GROUP)).astype(np.float32)),
        # the same codes two per byte (column 2j low, 2j + 1 high), for the XLA baseline
        "int4_packed": jnp.asarray(((int4_u[..., 1::2] << 4) | int4_u[..., 0::2]).astype(np.uint8)),
    }


def nf4_dequantize_then_dot(x, packed, absmax, n: int, k: int):
    """XLA's way without a kernel: decode the whole NF4 weight to bf16 (table gather), then dot."""
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1).astype(jnp.int32)
    w = (jnp.asarray(NF4_LEVELS, jnp.float32)[codes] * jnp.repeat(absmax, 64)).reshape(n, k).astype(BF16)
    return jax.lax.dot_general(x, w, NT, preferred_element_type=jnp.float32).astype(BF16)


def int4_dequantize_then_dot(x, packed, scale, n: int, k: int):
    """XLA's way without a kernel: unpack the nibbles, times the group scales, to bf16, then dot."""
    packed = packed.astype(jnp.int32)
    low, high = ((packed & 0xF) ^ 8) - 8, ((packed >> 4) ^ 8) - 8
    codes = jnp.stack([low, high], axis=-1).reshape(n, k)
    w = (codes.astype(jnp.float32) * jnp.repeat(scale, INT4_GROUP, axis=-1)).astype(BF16)
    return jax.lax.dot_general(x, w, NT, preferred_element_type=jnp.float32).astype(BF16)


def xla_int8_dot(x, w_q, w_scale):
    """XLA's own int8 dot_general on per-token int8 activations, rescaled as W8A8 does."""
    x_q, x_scale = quantize_activations(x)
    acc = jax.lax.dot_general(x_q, w_q, NT, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale[:, None] * w_scale[None, :]).astype(BF16)


def xla_fp8_dot(x, w_f8, w_scale):
    """XLA's own FP8 dot_general on per-token E4M3 activations (float32 accumulation), rescaled as fp8_matmul does."""
    x_q, x_scale = quantize_fp8_activations(x)
    acc = jax.lax.dot_general(x_q, w_f8, NT, preferred_element_type=jnp.float32)
    return (acc * x_scale[:, None] * w_scale[None, :]).astype(BF16)


def layer_methods(n: int, k: int, backend: str) -> dict:
    """name -> (per-layer function of (x, layer weights), the operands each layer takes)."""
    def w8a8(x, w):
        x_q, x_scale = quantize_activations(x)
        return int8_matmul(x_q, w["w_q"], x_scale, w["w_scale"], out_dtype=BF16, backend=backend)

    def fp8(x, w):
        x_q, x_scale = quantize_fp8_activations(x)
        return fp8_matmul(x_q, w["w_f8"], x_scale, w["f8_scale"], out_dtype=BF16, backend=backend)

    return {
        "bf16 XLA": (lambda x, w: jax.lax.dot_general(x, w["w_bf16"], NT, preferred_element_type=jnp.float32)
                     .astype(BF16), ("w_bf16",)),
        "int8 XLA dot": (lambda x, w: xla_int8_dot(x, w["w_q"], w["w_scale"]), ("w_q", "w_scale")),
        "fp8 XLA dot": (lambda x, w: xla_fp8_dot(x, w["w_f8"], w["f8_scale"]), ("w_f8", "f8_scale")),
        "NF4 XLA dequant+dot": (lambda x, w: nf4_dequantize_then_dot(x, w["packed"], w["absmax"], n, k),
                                ("packed", "absmax")),
        "int4 XLA dequant+dot": (lambda x, w: int4_dequantize_then_dot(x, w["int4_packed"], w["int4_scale"], n, k),
                                 ("int4_packed", "int4_scale")),
        "W8A8 int8_matmul": (w8a8, ("w_q", "w_scale")),
        "FP8 fp8_matmul": (fp8, ("w_f8", "f8_scale")),
        "W8A16 int8_weight_matmul": (lambda x, w: int8_weight_matmul(x, w["w_q"], w["w_scale"], out_dtype=BF16,
                                                                     backend=backend), ("w_q", "w_scale")),
        "NF4 nf4_matmul": (lambda x, w: nf4_matmul(x, w["packed"], w["absmax"], shape=(n, k), out_dtype=BF16,
                                                   backend=backend), ("packed", "absmax")),
        "W4A16 int4_weight_matmul": (lambda x, w: int4_weight_matmul(x, w["int4_q"], w["int4_scale"],
                                                                     group_size=INT4_GROUP, out_dtype=BF16,
                                                                     backend=backend), ("int4_q", "int4_scale")),
        "W4A16 prepared": (lambda x, w: prepared_matmul(x, w["int4_prepared"], out_dtype=BF16, backend=backend),
                           ("int4_prepared",)),
    }


def layer_buffers(stacked: dict, keys, layers: int) -> list[dict]:
    """Each layer's operands as buffers of their own (copies out of the stacked arrays, made once, untimed);
    "int4_prepared" is the layer's int4 weight packed once (prepare_int4)."""
    out = []
    for i in range(layers):
        layer = {}
        for key in keys:
            if key == "int4_prepared":
                layer[key] = prepare_int4(stacked["int4_q"][i], stacked["int4_scale"][i], INT4_GROUP)
            else:
                layer[key] = jnp.array(stacked[key][i], copy=True)
        out.append(layer)
    return jax.block_until_ready(out)


def time_per_layer(layer_fn, x, layer_weights: list[dict], repeats: int) -> float:
    """Seconds per layer of one jit running layer_fn on every layer's own buffers, unrolled."""
    forward = jax.jit(lambda x, layer_weights: [layer_fn(x, w) for w in layer_weights])
    return timed(lambda: forward(x, layer_weights), repeats) / len(layer_weights)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second the device reads in a jitted sum over 256 MiB (a weight-streaming stand-in)."""
    a = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    return a.nbytes / timed(lambda: total(a), repeats)


def floors(m: int, k: int, n: int, bandwidth: float) -> dict[str, float]:
    """Memory-bound floor (seconds) per layer: weight bytes in each format plus bf16 activations in and out."""
    act = 2 * m * k + 2 * m * n
    weights = {"bf16": 2 * n * k, "int8": n * k + 4 * n, "fp8": n * k + 4 * n, "nf4": n * k // 2 + 4 * n * k // 64,
               "int4": n * k // 2 + 4 * n * k // INT4_GROUP}
    return {name: (b + act) / bandwidth for name, b in weights.items()}


@contextlib.contextmanager
def no_op_kernels():
    """Swap every dense Pallas kernel for a no-op returning zeros of its output shape."""
    names = ("int8_matmul_tpu", "fp8_matmul_tpu", "int8_weight_matmul_tpu", "nf4_matmul_tpu",
             "int4_weight_matmul_tpu"), (
        "int8_matmul_gpu", "fp8_matmul_gpu", "int8_weight_matmul_gpu", "nf4_matmul_gpu", "int4_weight_matmul_gpu")
    saved = []
    for module, module_names in zip((tpu_dense, gpu_dense), names):
        for name in module_names:
            saved.append((module, name, getattr(module, name)))

            def no_op(*args, tiling, out_dtype, **_):
                return jnp.zeros((args[0].shape[0], args[-1].shape[1]), out_dtype)

            setattr(module, name, no_op)
    jax.clear_caches()
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
        jax.clear_caches()


def entry_overheads(backend: str, repeats: int) -> list[str]:
    """Per entry point: eager call and jitted call (microseconds), kernel swapped for a no-op."""
    m, k, n = 16, 4096, 4096
    ops = stacked_operands(1, m, k, n)
    x, w_q, w_scale = ops["x"], ops["w_q"][0], ops["w_scale"][0]
    x_q, x_scale = quantize_activations(x)
    x_f8, x_f8_scale = quantize_fp8_activations(x)
    w_f8, f8_scale = ops["w_f8"][0], ops["f8_scale"][0]
    packed, absmax = ops["packed"][0], ops["absmax"][0]
    int4_q, int4_scale = ops["int4_q"][0], ops["int4_scale"][0]
    calls = {
        "int8_matmul": lambda a, b, c, d: int8_matmul(a, b, c, d, out_dtype=BF16, backend=backend),
        "fp8_matmul": lambda a, b, c, d: fp8_matmul(a, b, c, d, out_dtype=BF16, backend=backend),
        "int8_weight_matmul": lambda a, b, c, d: int8_weight_matmul(a, b, c, out_dtype=BF16, backend=backend),
        "nf4_matmul": lambda a, b, c, d: nf4_matmul(a, b, c, shape=(n, k), out_dtype=BF16, backend=backend),
        "int4_weight_matmul": lambda a, b, c, d: int4_weight_matmul(a, b, c, group_size=INT4_GROUP, out_dtype=BF16,
                                                                    backend=backend),
    }
    operands = {"int8_matmul": (x_q, w_q, x_scale, w_scale), "fp8_matmul": (x_f8, w_f8, x_f8_scale, f8_scale), "int8_weight_matmul": (x, w_q, w_scale, None),
                "nf4_matmul": (x, packed, absmax, None), "int4_weight_matmul": (x, int4_q, int4_scale, None)}
    lines = []
    with no_op_kernels():
        for name, call in calls.items():
            args = operands[name]
            group = INT4_GROUP if name == "int4_weight_matmul" else None
            x_dtype = "float8_e4m3fn" if name == "fp8_matmul" else "float32"
            plan = select_kernel(KernelProblem(name, m, k, n, x_dtype, group_size=group), backend)
            eager = timed(lambda: call(*args), repeats * 20)
            jitted_fn = jax.jit(call)
            jitted = timed(lambda: jitted_fn(*args), repeats * 20)
            lines.append(f"| {name} | {m}x{k}x{n} | {plan.describe()} | {eager * 1e6:.0f} | {jitted * 1e6:.0f} | "
                         f"{(eager - jitted) * 1e6:.0f} |")
    return lines


def bench_shape(m: int, k: int, n: int, layers: int, backend: str, repeats: int, bandwidth: float) -> list[str]:
    ops = stacked_operands(layers, m, k, n)
    times = {}
    for name, (fn, keys) in layer_methods(n, k, backend).items():
        times[name] = time_per_layer(fn, ops["x"], layer_buffers(ops, keys, layers), repeats)
    floor = floors(m, k, n, bandwidth)
    bf16, int8_xla, nf4_xla = times["bf16 XLA"], times["int8 XLA dot"], times["NF4 XLA dequant+dot"]
    int4_xla, fp8_xla = times["int4 XLA dequant+dot"], times["fp8 XLA dot"]
    lines = []
    for name, seconds in times.items():
        fmt = ("int4" if ("int4" in name or "W4" in name) else "nf4" if "NF4" in name
               else "fp8" if "fp8" in name.lower() else "int8" if ("int8" in name or "W8" in name) else "bf16")
        own = {"int8": int8_xla, "fp8": fp8_xla, "nf4": nf4_xla, "int4": int4_xla, "bf16": bf16}[fmt]
        lines.append(f"| {name} | {m} | {k}x{n} | {seconds * 1e6:.1f} | {bf16 / seconds:.2f} | {own / seconds:.2f} | "
                     f"{floor[fmt] * 1e6:.1f} ({fmt}) |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU interpret mode)")
    parser.add_argument("--m", type=int, nargs="*", help="row counts M")
    parser.add_argument("--kn", nargs="*", help="KxN pairs, e.g. 4096x14336")
    parser.add_argument("--layers", type=int, help="layers (weight buffers) per jit (default 16; 4 with --quick)")
    parser.add_argument("--backend", default="auto", help="auto, tpu, gpu, cpu or reference")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ms = args.m or ([1, 16] if args.quick else [1, 16, 64, 512, 4096])
    kns = [tuple(int(v) for v in kn.split("x")) for kn in args.kn] if args.kn else (
        [(512, 512), (576, 1536)] if args.quick else [(4096, 4096), (4096, 14336)])
    layers = args.layers or (4 if args.quick else 16)
    backend = resolve_backend(args.backend)
    device = jax.devices()[0]
    bandwidth = read_bandwidth(args.repeats)
    print(f"# device: {device.platform} {device.device_kind}; host: {platform.processor() or platform.machine()}; "
          f"jax {jax.__version__}; backend {backend}; {layers} layers (own buffers) per jit; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("\n## Eager per-call overhead (kernel swapped for a no-op)\n")
    print("| entry point | MxKxN | plan | eager us | inside jit us | overhead us |")
    print("|---|---|---|---|---|---|")
    for line in entry_overheads(backend, args.repeats):
        print(line, flush=True)
    print("\n## Per-layer time, each layer its own weight buffer, unrolled in one jit (bf16 in and out)\n")
    print("| method | M | KxN | us per layer | bf16 XLA / method | same-format XLA / method | memory floor us |")
    print("|---|---|---|---|---|---|---|")
    for k, n in kns:
        for m in ms:
            for line in bench_shape(m, k, n, layers, backend, args.repeats, bandwidth):
                print(line, flush=True)


if __name__ == "__main__":
    main()
