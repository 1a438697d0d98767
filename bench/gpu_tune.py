"""Sweep the GPU kernel variants and tile sizes per shape, check each against the reference, write the tuned table.

    python bench/gpu_tune.py --json $OUT/gpu_tune.json --markdown $OUT/gpu_tune.md --table $OUT/gpu_tuned.json
    python bench/gpu_tune.py --smoke        # CPU: interpret mode, tiny shapes, end to end in seconds

For every weight format (NF4, int4 with groups of 128, W8A16, W8A8 int8 and
FP8), M (1, 4096, 512, 8, 64: the most telling first) and (K, N) of
Llama-3-8B's linears (4096x4096, 4096x14336, 14336x4096, 4096x1024) and
Qwen3-30B-A3B's experts (2048x768, 768x2048), each candidate (a
gpu_tuning.Variant and a tiling) runs on prepared weights (prepared.py) in the
fixed harness: L layers, each its own weight buffer, unrolled in one jit (no
layer slices its weight out of a stacked array, which a Pallas call would pay
as a copy). Beside them run bf16 XLA, XLA's own int8 and FP8 dots, and XLA's
dequantize-then-dot (the "xla" variant). Each candidate's first layer is
checked against the reference (backend "xla": reference.py's code); a wrong or
failing candidate is recorded and never wins. After every shape the partial
results, the winners' table (the file kernels/gpu_tuning.py reads) and the
markdown table are rewritten, so a run cut off still leaves what it measured;
a time budget inside (--budget, compilation included) stops it between
shapes and the outputs say how far it got.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.kernels import (KernelProblem, gpu_decode, gpu_dense, gpu_grouped, gpu_grouped_decode, gpu_prefill,
                              prepared)
from qconvert.kernels.gpu_tuning import Variant, write_tuned
from qconvert.kernels.plan import platform, variant_fits
from qconvert.kernels.tile_tables import default_tiling
from qconvert.kernels.tiles import Tiling

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_tune_moe  # noqa: E402

BF16 = jnp.bfloat16
NT = (((1,), (1,)), ((), ()))
MS = (1, 4096, 512, 8, 64)
KNS = ((4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024), (2048, 768), (768, 2048))
FORMATS = ("nf4", "int4", "w8a16", "int8", "fp8")  # the furthest from their targets first
OPS = {"nf4": "nf4_matmul", "int4": "int4_weight_matmul", "w8a16": "int8_weight_matmul", "int8": "int8_matmul",
       "fp8": "fp8_matmul"}
INT4_GROUP = 128
MOE_EXPERTS, MOE_TOP = 128, 8  # Qwen3-30B-A3B
MOE_KINDS = {"nf4": "nf4", "int4": "int4", "w8a16": "int8", "int8": "int8", "fp8": "fp8"}  # expert rhs kind
SMS = 132  # an H100's SMs (an H200 has as many): split-K aims for two programs per SM
TOLERANCE = 2e-2  # largest error / largest output; a bf16 output carries 4e-3 of rounding


def format_weight(fmt: str, n: int, k: int, key) -> prepared.PreparedWeight:
    """A random prepared weight [n, k] in fmt, made on the device (random bytes are random codes)."""
    k1, k2 = jax.random.split(key)
    if fmt in ("w8a16", "int8"):
        codes = jax.random.randint(k1, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
        return prepared.channel_weight("int8", codes, jax.random.uniform(k2, (n,), jnp.float32, 1e-3, 1e-2))
    if fmt == "fp8":
        codes = (jax.random.normal(k1, (n, k), jnp.float32) * 40).astype(jnp.float8_e4m3fn)
        return prepared.channel_weight("fp8", codes, jax.random.uniform(k2, (n,), jnp.float32, 1e-3, 1e-2))
    packed = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32)
    if fmt == "nf4":
        return prepared.nf4_weight(packed.astype(jnp.uint8), jax.random.uniform(k2, (n * k // 64,), jnp.float32,
                                                                                0.1, 1.0), n, k)
    return prepared.PreparedWeight("int4", n, k, INT4_GROUP, (packed - 128).astype(jnp.int8),
                                   jax.random.uniform(k2, (n, k // INT4_GROUP), jnp.float32, 1e-2, 2e-2))


def candidates(fmt: str, m: int, k: int, n: int, smoke: bool) -> list[tuple[Variant, Tiling]]:
    """The (variant, tiling) pairs worth timing at a shape: few, so the sweep fits its budget."""
    problem = KernelProblem(OPS[fmt], m, k, n, "bfloat16", "bfloat16", group_size=INT4_GROUP if fmt == "int4" else None)
    tk = 256 if fmt in ("nf4", "int4") else 128
    out = [(Variant("tiled"), default_tiling(problem, "gpu"))]
    if smoke:  # one Triton variant per regime, and XLA's path: the plumbing, not a search
        variant = Variant("splitk", split=2) if m <= 16 else Variant("pipelined")
        return [(v, t) for v, t in ((variant, Tiling(16, 128, 32)), (Variant("xla"), out[0][1]))
                if variant_fits(problem, v, t)]
    if m <= 16:
        for tn, variant in ((64, "splitk"), (128, "swapab"), (32, "gemv")):
            if variant == "gemv" and m > 1:
                continue
            split = 1
            while (n // tn) * split < 2 * SMS and (k // tk) % (split * 2) == 0 and split < 16:
                split *= 2
            out.append((Variant(variant, split=split, num_warps=4, num_stages=4), Tiling(16, tk, tn)))
    elif m <= 64:
        out += [(Variant("swapab", split=2, num_stages=4), Tiling(64, tk, 128)),
                (Variant("pipelined", num_warps=4, num_stages=4), Tiling(64, 64 if tk == 128 else tk, 128))]
    else:
        ktile = 64 if fmt in ("w8a16", "int8", "fp8") else 128
        out += [(Variant("pipelined", num_warps=8, num_stages=4), Tiling(128, ktile, 128)),
                (Variant("pipelined", num_warps=8, num_stages=3), Tiling(128, ktile, 256))]
    out.append((Variant("xla"), out[0][1]))
    return [(v, t) for v, t in out if variant_fits(problem, v, t)]


def per_layer_us(step, x, layers, repeats: int) -> tuple[float, jax.Array]:
    """(microseconds per layer, the first layer's output): L layers, each its own weight buffer, unrolled in
    one jit, compiled (and its output kept for the check) before the timed runs."""
    f = jax.jit(lambda x, layers: [step(x, w) for w in layers])
    first = jax.block_until_ready(f(x, layers))[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(x, layers))
        times.append(time.perf_counter() - start)
    return 1e6 * float(np.median(times)) / len(layers), first


def act_of(fmt: str) -> str | None:
    return "dynamic" if fmt in ("int8", "fp8") else None


def run_shape(fmt, m, k, n, x, layers, repeats, smoke) -> list[dict]:
    """Every candidate of one format at one shape: time, error against the reference, or the error raised."""
    act = act_of(fmt)
    want = np.asarray(prepared.prepared_matmul(x, layers[0], act=act, backend="xla", out_dtype=BF16), np.float32)
    rows = []
    for variant, tiling in candidates(fmt, m, k, n, smoke):
        row = {"format": fmt, "op": OPS[fmt], "m": m, "k": k, "n": n, "variant": variant.as_json(),
               "tiling": [tiling.tm, tiling.tk, tiling.tn]}
        try:
            def step(x, w, variant=variant, tiling=tiling):
                return prepared.prepared_matmul(x, w, act=act, backend="gpu", variant=variant, tiling=tiling,
                                                out_dtype=BF16)
            row["us"], got = per_layer_us(step, x, layers, repeats)
            got = np.asarray(got, np.float32)
            row["rel_err"] = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
            row["ok"] = row["rel_err"] <= TOLERANCE
        except Exception as e:  # a candidate that does not compile or run is a result to record, not a stop
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        rows.append(row)
    return rows


def baselines(m, k, n, x, layers_bf16, repeats) -> dict:
    """bf16 XLA at one shape (XLA's own int8 and FP8 dots and dequantize-then-dot are the "xla" candidates)."""
    def bf16(x, w):
        return jax.lax.dot_general(x, w, NT, preferred_element_type=jnp.float32).astype(BF16)

    return {"m": m, "k": k, "n": n, "bf16_us": per_layer_us(bf16, x, layers_bf16, repeats)[0]}


def floor_us(fmt: str, m: int, k: int, n: int, bandwidth: float) -> float:
    """The memory-bound floor: the layer's weight bytes in its format plus bf16 activations in and out."""
    weight = {"nf4": n * k // 2 + 4 * n * k // 64, "int4": n * k // 2 + 4 * n * k // INT4_GROUP}.get(fmt, n * k + 4 * n)
    return 1e6 * (weight + 2 * m * k + 2 * m * n) / bandwidth


def winners(rows: list[dict]) -> list[dict]:
    """The fastest right candidate of each (op, m, k, n)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["op"], row["m"], row["k"], row["n"])
        if row.get("ok") and (key not in best or row["us"] < best[key]["us"]):
            best[key] = row
    return list(best.values())


def markdown(rows: list[dict], base: dict, bandwidth: float, device: str, status: str) -> str:
    """The winners beside bf16 XLA, the same format's XLA path (the "xla" candidate) and the memory floor."""
    lines = [f"Device: {device}; {status}", "",
             "| format | M | KxN | winner | tiling | us | bf16 XLA us | bf16 / winner | XLA same-format / winner "
             "| floor us |", "|---|---|---|---|---|---|---|---|---|---|"]
    xla = {(r["format"], r["m"], r["k"], r["n"]): r["us"] for r in rows
           if r.get("ok") and r["variant"]["name"] == "xla"}
    order = FORMATS + gpu_tune_moe.FP4_KINDS
    for row in sorted(winners(rows), key=lambda r: (order.index(r["format"]), r["k"], r["n"], r["m"])):
        us = row["us"]
        grouped = row["op"].startswith("grouped")
        b = base.get(("moe" if grouped else "dense", row["m"], row["k"], row["n"]), {}).get("bf16_us")
        same = xla.get((row["format"], row["m"], row["k"], row["n"]))
        b_text = "- | -" if b is None else f"{b:.1f} | {b / us:.2f}"
        same_text = "-" if same is None else f"{same / us:.2f}"
        # MoE rows: M is the routed rows (tokens x top-k), bf16 XLA is ragged_dot, no floor is computed
        what, m_text = (f"{row['format']} experts", f"{row['m']} ({row['tokens']} tok)") if grouped else (
            row["format"], str(row["m"]))
        floor = "-" if grouped else f"{floor_us(row['format'], row['m'], row['k'], row['n'], bandwidth):.1f}"
        lines.append(f"| {what} | {m_text} | {row['k']}x{row['n']} | {Variant(**row['variant'])} | "
                     f"{'x'.join(map(str, row['tiling']))} | {us:.1f} | {b_text} | {same_text} | {floor} |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def interpreted():
    """The Triton kernels in Pallas' generic interpreter (a CPU has no GPU to compile them for)."""
    patched = [(gpu_decode, "split_partials"), (gpu_prefill, "pipelined_matmul"),
               (gpu_grouped_decode, "grouped_gemv_partials"), (gpu_grouped, "grouped_matmul_gpu")] + [
        (gpu_dense, name) for name in ("int8_matmul_gpu", "fp8_matmul_gpu", "int8_weight_matmul_gpu",
                                       "nf4_matmul_gpu", "int4_weight_matmul_gpu")]
    saved = [(module, name, getattr(module, name)) for module, name in patched]
    for module, name, kernel in saved:
        setattr(module, name, functools.wraps(kernel)(lambda *a, _k=kernel, **kw: _k(*a, **{**kw, "interpret": True})))
    jax.clear_caches()
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
        jax.clear_caches()


def read_bandwidth() -> float:
    """Bytes per second the device reads in a jitted sum over 256 MiB (64 KiB on a smoke run's CPU)."""
    a = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(5):
        total(a).block_until_ready()
    return 5 * a.nbytes / (time.perf_counter() - start)


def shape_order(ms, kns, moe_kns=()) -> list[tuple[int, tuple[int, int], bool]]:
    """The order shapes (M, (K, N), grouped) run in, most telling first: decode and prefill (the first two
    Ms) on the first two dense (K, N), then those Ms on the other dense shapes and the MoE experts (grouped,
    M tokens), then every other M over all of them."""
    lead, lead_kns = list(ms[:2]), list(kns[:2])
    shapes = [(kn, False) for kn in kns] + [(kn, True) for kn in moe_kns]
    order = [(m, kn, False) for kn in lead_kns for m in lead]
    order += [(m, kn, grouped) for m in lead for kn, grouped in shapes if grouped or kn not in lead_kns]
    return order + [(m, kn, grouped) for m in ms[2:] for kn, grouped in shapes]


def moe_shape(m, k, n, kinds, layers_n, repeats, smoke, key) -> tuple[dict, list[dict]]:
    """Qwen3-30B-A3B's experts at m tokens: (the bf16 ragged_dot baseline, every expert kind's candidates)."""
    experts, top = (4, 2) if smoke else (MOE_EXPERTS, MOE_TOP)
    sizes = gpu_tune_moe.routing(m, experts, top, jax.random.fold_in(key, 7 * m))
    x = jax.random.normal(jax.random.fold_in(key, m), (m * top, k), jnp.float32).astype(BF16)
    base = {"kind": "moe", "tokens": m, "m": m * top, "k": k, "n": n, "bf16_us": gpu_tune_moe.bf16_ragged_dot_us(
        x, sizes, experts, k, n, layers_n, key, repeats, per_layer_us)}
    rows = []
    for kind in kinds:
        layers = [gpu_tune_moe.expert_weights(kind, experts, n, k, jax.random.fold_in(key, 200 + i))
                  for i in range(layers_n)]
        rows += gpu_tune_moe.run_moe(kind, m, k, n, x, sizes, layers, repeats, smoke, per_layer_us, TOLERANCE)
    return base, rows


def sweep(args) -> int:
    start = time.monotonic()
    device = jax.devices()[0]
    device_name = f"{device.platform} {device.device_kind}"
    smoke = args.smoke
    ms = args.m or ((1, 64) if smoke else MS)
    kns = [tuple(int(v) for v in kn.split("x")) for kn in args.kn] if args.kn else (
        [(256, 64)] if smoke else KNS)
    formats = args.formats or FORMATS
    layers_n = args.layers or (1 if smoke else 8)
    repeats = args.repeats or (1 if smoke else 5)
    bandwidth = 1e9 if smoke else read_bandwidth()
    rows: list[dict] = []
    base: dict = {}
    moe_kns = [] if args.no_moe else [(256, 64)] if smoke else gpu_tune_moe.KNS
    # the formats' expert kinds; FP4 experts (no dense variants here) unless --formats names the formats
    moe_kinds = list(dict.fromkeys(MOE_KINDS[fmt] for fmt in formats)) + (
        [] if args.formats else list(gpu_tune_moe.FP4_KINDS))
    order = shape_order(ms, kns, moe_kns)
    done = 0
    status = "not started"
    key = jax.random.PRNGKey(0)
    for m, (k, n), grouped in order:
        what = f"{'MoE experts, ' if grouped else ''}M={m} {k}x{n}"
        if time.monotonic() - start > args.budget:
            status = (f"stopped at the {args.budget:.0f} s budget after {done} of {len(order)} shapes; next was "
                      f"{what}")
            break
        if grouped:
            moe_base, moe_rows = moe_shape(m, k, n, moe_kinds, layers_n, repeats, smoke, key)
            base[("moe", moe_base["m"], k, n)] = moe_base
            rows += moe_rows
        else:
            dense_shape(m, k, n, formats, layers_n, repeats, smoke, key, base, rows)
        done += 1
        status = f"{done} of {len(order)} shapes in {time.monotonic() - start:.0f} s"
        write_outputs(args, rows, base, bandwidth, device_name, status, complete=done == len(order))
        print(f"[{time.monotonic() - start:6.1f} s] {what}: {status}", flush=True)
    write_outputs(args, rows, base, bandwidth, device_name, status, complete=done == len(order))
    wrong = [r for r in rows if not r.get("ok")]
    print(markdown(rows, base, bandwidth, device_name, status))
    print(f"{len(rows)} candidates timed, {len(wrong)} wrong or failed; {status}")
    for row in wrong:
        print(f"  not used: {row['format']} M={row['m']} {row['k']}x{row['n']} {Variant(**row['variant'])} "
              f"{row['tiling']}: {row.get('error') or 'rel_err %.3g' % row['rel_err']}")
    return 0


def dense_shape(m, k, n, formats, layers_n, repeats, smoke, key, base, rows) -> None:
    """One dense shape: the bf16 baseline into base, every format's candidates onto rows."""
    x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(BF16)
    layers_bf16 = [jax.random.normal(jax.random.fold_in(key, i), (n, k), BF16) for i in range(layers_n)]
    base[("dense", m, k, n)] = {"kind": "dense", **baselines(m, k, n, x, layers_bf16, repeats)}
    del layers_bf16
    for fmt in formats:
        layers = [format_weight(fmt, n, k, jax.random.fold_in(key, 100 + i)) for i in range(layers_n)]
        rows += run_shape(fmt, m, k, n, x, layers, repeats, smoke)
        del layers


def write_outputs(args, rows, base, bandwidth, device, status, complete: bool) -> None:
    """Rewrite every output from what is measured so far (each file replaced whole)."""
    if args.json:
        doc = {"device": device, "status": status, "complete": complete, "budget_s": args.budget,
               "read_bandwidth_gbs": bandwidth / 1e9, "baselines": list(base.values()), "candidates": rows,
               "winners": winners(rows)}
        replace_text(Path(args.json), json.dumps(doc, indent=1) + "\n")
    if args.table:
        entries = [{key: row[key] for key in ("op", "m", "k", "n", "variant", "tiling", "us")} for row in winners(rows)]
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        write_tuned(Path(args.table), device, entries)
    if args.markdown:
        replace_text(Path(args.markdown), markdown(rows, base, bandwidth, device, status))


def replace_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU run: interpret mode, tiny shapes, seconds")
    parser.add_argument("--json", help="write every candidate's result, the baselines and the winners here")
    parser.add_argument("--table", help="write the winners as a tuned table here (kernels/gpu_tuned.json's form)")
    parser.add_argument("--markdown", help="write the winners' table for docs/BENCHMARKS.md here")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds (compilation included) after which no new shape starts (default 300)")
    parser.add_argument("--m", type=int, nargs="*", help="row counts M, in the order to sweep them")
    parser.add_argument("--kn", nargs="*", help="KxN pairs, e.g. 4096x14336")
    parser.add_argument("--formats", nargs="*", choices=FORMATS, help="weight formats (default: all)")
    parser.add_argument("--no-moe", action="store_true", help="skip the grouped (MoE experts) shapes")
    parser.add_argument("--layers", type=int, help="weight buffers per timed jit (default 8; 1 with --smoke)")
    parser.add_argument("--repeats", type=int, help="timed runs per candidate (default 5; 1 with --smoke)")
    args = parser.parse_args(argv)
    if args.smoke:
        with interpreted():
            return sweep(args)
    if platform() != "gpu":
        print(f"bench/gpu_tune.py times Triton kernels: JAX runs on {platform()}, not a GPU "
              "(--smoke runs the sweep in interpret mode on a CPU)", file=sys.stderr)
        return 2
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
