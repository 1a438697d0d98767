"""GPTQ's solve against the matmul floor: gptq_codes' time beside one float32 matmul of the same FLOPs.

    python bench/gptq_floor.py                   # SmolLM2, Qwen3-30B-A3B's experts, Llama-3-8B's down_proj rows
    python bench/gptq_floor.py --repeat 5        # best of 5 (default 3)
    python bench/gptq_floor.py --shape 576x1536  # one shape, rows x input width (repeatable)
    python bench/gptq_floor.py --against DIR     # also DIR's gptq_core (another checkout), timed in turn

Per shape [rows, in], one process, int4 with groups of 128 (act order on, as the pipeline runs it), float32:

  floor      a plain [rows, in] @ [in, in] float32 matmul: 2 rows in^2 FLOP, the column loop's FLOP count
             (its lazy updates are rows in^2, its in-block updates rows in 128)
  loop       round_columns (the column loop) on a factor computed beforehand
  factor     hessian_factor (the damped inverse's Cholesky factor: about 4/3 in^3 FLOP)
  gptq       gptq_codes, the factor and the loop, as the tests and bench/scaling_model.py count them

Each is compiled first and timed best of --repeat; with --against, this checkout's loop and DIR's are timed
in turn, a call of each per round, so both see the same load (on a shared host the load moves the floor 2x
within minutes). The ratios are loop / floor and gptq / floor (the factor
has its own FLOP, but the floor is what one device would spend on the rows at the matmul rate). Llama-3-8B's
down_proj (4096 x 14336) runs on 256 of its rows, the loop alone: the loop's time is linear in the rows, and
the factor of a 14,336-wide Hessian (about 4 TFLOP, the same code before and after) takes minutes on a CPU;
inputs wider than FACTOR_WIDTH time the loop alone, on a synthetic U (upper triangular, a positive diagonal,
act order's permutation random): the loop does the same work whatever U holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qconvert.formats.layout_base import LayoutFlags  # noqa: E402
from qconvert.methods.gptq_core import gptq_codes, hessian_factor, round_columns  # noqa: E402
from qconvert.schemes import scheme_named  # noqa: E402

SHAPES = {"SmolLM2 (576 x 1536)": (576, 1536),
          "Qwen3-30B-A3B expert down (2048 x 768)": (2048, 768),
          "Qwen3-30B-A3B expert gate/up (1536 x 2048)": (1536, 2048),
          "Llama-3-8B down_proj, 256 of 4096 rows (256 x 14336)": (256, 14336)}


FACTOR_WIDTH = 8192


def best(fn, repeat: int) -> float:
    return best_of({"": fn}, repeat)[""]


def best_of(fns: dict, repeat: int) -> dict[str, float]:
    """Each function's best time over `repeat` rounds, one call of each a round (compiled before)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            started = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - started)
    return {name: min(t) for name, t in times.items()}


def other_core(folder: str):
    """Another checkout's qconvert/methods/gptq_core.py, as a module of its own."""
    spec = importlib.util.spec_from_file_location("other_gptq_core", Path(folder) / "qconvert/methods/gptq_core.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def inputs(rows: int, width: int, seed: int = 0):
    """A weight, its int4 steps and a Hessian of correlated inputs (more tokens than the width: full rank; None
    above FACTOR_WIDTH)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, width), np.float32) * 0.02
    scheme, flags = scheme_named("int4"), LayoutFlags(group_size=128)
    q = scheme.quantize(w, flags, scale_dtype=np.float32)
    steps = jnp.asarray(scheme.gptq_steps(q, flags))
    if width > FACTOR_WIDTH:
        return jnp.asarray(w), None, steps, scheme.gptq_grid()
    mix = rng.standard_normal((width, width), np.float32) / np.sqrt(width)
    x = rng.standard_normal((width + 256, width), np.float32) @ (np.eye(width, dtype=np.float32) + 0.3 * mix)
    h = (2.0 / x.shape[0]) * (x.T @ x)
    return jnp.asarray(w), jnp.asarray(h, jnp.float32), steps, scheme.gptq_grid()


def measure(rows: int, width: int, repeat: int, other=None) -> dict[str, float]:
    w, h, steps, grid = inputs(rows, width)
    a = jnp.asarray(np.random.default_rng(1).standard_normal((rows, width), np.float32))
    b = jnp.asarray(np.random.default_rng(2).standard_normal((width, width), np.float32))
    matmul = jax.jit(lambda a, b: a @ b)
    if width > FACTOR_WIDTH:
        rng = np.random.default_rng(3)
        u = jnp.triu(jnp.asarray(rng.standard_normal((width, width), np.float32) * (0.1 / np.sqrt(width))), 1)
        u, perm, dead = u + jnp.eye(width), jnp.asarray(rng.permutation(width)), jnp.zeros(width, bool)
    else:
        u, perm, dead = hessian_factor(h, 0.1, act_order=True)
    fns = {"floor": lambda: matmul(a, b), "loop": lambda: round_columns(w, steps, u, perm, dead, grid=grid)}
    if other is not None:
        fns["other"] = lambda: other.round_columns(w, steps, u, perm, dead, grid=grid)
    times = best_of(fns, repeat)
    if width <= FACTOR_WIDTH:
        times["factor"] = best(lambda: hessian_factor(h, 0.1, act_order=True), repeat)
        times["gptq"] = best(lambda: gptq_codes(w, h, steps, 0.1, grid=grid, act_order=True), repeat)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shape", action="append", default=[], help="ROWSxIN (repeatable)")
    parser.add_argument("--against", metavar="DIR", help="another checkout whose column loop is timed in turn")
    opts = parser.parse_args()
    other = other_core(opts.against) if opts.against else None
    shapes = ({s: tuple(int(v) for v in s.split("x")) for s in opts.shape} if opts.shape else SHAPES)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"load {load:.1f}, best of {opts.repeat}, int4 g128 act order, float32")
    against = " | DIR's loop | DIR's / floor" if other else ""
    print(f"| shape | floor (2 rows in^2) | column loop | loop / floor | factor | gptq_codes | gptq / floor{against} |")
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if other else ""))
    for name, (rows, width) in shapes.items():
        t = measure(rows, width, opts.repeat, other)
        rest = (f"{t['factor'] * 1e3:.0f} ms | {t['gptq'] * 1e3:.0f} ms | {t['gptq'] / t['floor']:.1f}x" if "gptq" in t
                else "- | - | -")
        if other:
            rest += f" | {t['other'] * 1e3:.0f} ms | {t['other'] / t['floor']:.1f}x"
        print(f"| {name} | {t['floor'] * 1e3:.0f} ms | {t['loop'] * 1e3:.0f} ms | {t['loop'] / t['floor']:.1f}x | "
              f"{rest} |", flush=True)


if __name__ == "__main__":
    main()
