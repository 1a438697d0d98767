"""The grouped (MoE) part of bench/gpu_tune.py: Qwen3-30B-A3B's experts (128 of them, top 8) per kernel variant.

M tokens each pick 8 distinct experts (random scores, top 8), so the grouped
matmul sees 8M rows sorted by expert; each expert's weight is [N, K] in the
format (int8 and FP8 experts take their rows as float values, as
qgrouped_linear feeds them; NVFP4 and MXFP4 experts are E2M1 codes with their
group scales, NVFP4's over a global scale per expert, both tuned as the one
grouped_matmul/fp4 entry the plans read, every candidate's K tile holding whole
groups of either). Candidates: the tiled kernel (gpu_grouped) at its
tile-table tiling and one other, and at decode the GEMV variant
(gpu_grouped_decode); beside them bf16 XLA's `ragged_dot` on the same routing.
Each candidate's first layer is checked against the reference (backend "xla").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qconvert.formats import QArray
from qconvert.kernels import KernelProblem, grouped_matmul
from qconvert.kernels.gpu_tuning import Variant
from qconvert.kernels.plan import variant_fits
from qconvert.kernels.tile_tables import default_tiling
from qconvert.kernels.tiles import Tiling

BF16 = jnp.bfloat16
FP4_KINDS = ("nvfp4", "mxfp4")  # FP4 experts: the grouped kernels' "fp4" rhs, NVFP4's groups of 16 or MXFP4's of 32
KINDS = ("nf4", "int4", "int8", "fp8") + FP4_KINDS
KNS = ((2048, 768), (768, 2048))
INT4_GROUP = 128
FP4_GROUPS = {"nvfp4": 16, "mxfp4": 32}


def rhs_kind(kind: str) -> str:
    """The grouped matmul's rhs kind of an expert kind (its tuned-table entry is grouped_matmul/<this>)."""
    return "fp4" if kind in FP4_KINDS else kind


def group_size(kind: str) -> int | None:
    """Input columns per scale of an expert kind's weights (None: NF4's blocks, or one scale per channel)."""
    return INT4_GROUP if kind == "int4" else FP4_GROUPS.get(kind)


def routing(m: int, experts: int, top: int, key) -> jax.Array:
    """Rows per expert [experts] int32 when each of m tokens picks `top` distinct experts."""
    chosen = jax.lax.top_k(jax.random.uniform(key, (m, experts)), top)[1]
    return jnp.bincount(chosen.reshape(-1), length=experts).astype(jnp.int32)


def expert_weights(kind: str, g: int, n: int, k: int, key):
    """(rhs, rhs_scale) of g random experts [N, K] in `kind`, as grouped_matmul takes them (transpose_rhs)."""
    k1, k2 = jax.random.split(key)
    if kind in FP4_KINDS:
        return fp4_expert_weights(kind, g, n, k, key), None
    if kind == "nf4":
        packed = jax.random.randint(k1, (g * n * k // 2,), 0, 256, jnp.int32).astype(jnp.uint8)
        absmax = jax.random.uniform(k2, (g * n * k // 64,), jnp.float32, 0.1, 1.0)
        return QArray(packed, absmax, kind="nf4", block_size=64, shape=(g, n, k), dtype=BF16), None
    if kind == "int4":
        codes = jax.random.randint(k1, (g, n, k), -8, 8, jnp.int32).astype(jnp.int8)
        scale = jax.random.uniform(k2, (g, n, k // INT4_GROUP), jnp.float32, 1e-2, 2e-2)
        return QArray(codes, scale, kind="int4", block_size=INT4_GROUP, shape=(g, n, k), dtype=BF16), None
    scale = jax.random.uniform(k2, (g, n, 1), jnp.float32, 1e-3, 1e-2)
    if kind == "fp8":
        codes = (jax.random.normal(k1, (g, n, k), jnp.float32) * 40).astype(jnp.float8_e4m3fn)
        return QArray(codes, scale, kind="fp8", shape=(g, n, k), dtype=BF16), None
    return jax.random.randint(k1, (g, n, k), -127, 128, jnp.int32).astype(jnp.int8), scale.reshape(g, n)


def fp4_expert_weights(kind: str, g: int, n: int, k: int, key) -> QArray:
    """g random FP4 experts [N, K]: E2M1 codes, E4M3 group scales over a global scale per expert (NVFP4) or
    power-of-two ones (MXFP4), as an fp4 QArray of logical shape (G, N, K)."""
    k1, k2, k3 = jax.random.split(key, 3)
    group = FP4_GROUPS[kind]
    codes = jax.random.randint(k1, (g, n, k), 0, 16, jnp.int32).astype(jnp.uint8)
    if kind == "mxfp4":
        scale = jnp.exp2(jax.random.randint(k2, (g, n, k // group), -9, -5).astype(jnp.float32))
        return QArray(codes, scale, kind="fp4", block_size=group, shape=(g, n, k), dtype=BF16)
    scale = jax.random.uniform(k2, (g, n, k // group), jnp.float32, 1.0, 448.0)
    scale = scale.astype(ml_dtypes.float8_e4m3fn).astype(jnp.float32)  # E4M3 values, as the format holds them
    w_global = 448.0 * 6.0 / jax.random.uniform(k3, (g, 1, 1), jnp.float32, 0.5, 2.0)
    return QArray(codes, scale, w_global, kind="fp4", block_size=group, shape=(g, n, k), dtype=BF16)


def problem_of(kind: str, rows: int, k: int, n: int, g: int) -> KernelProblem:
    return KernelProblem("grouped_matmul", rows, k, n, "bfloat16", "bfloat16", num_groups=g, rhs_kind=rhs_kind(kind),
                         group_size=group_size(kind))


def candidates(kind: str, rows: int, k: int, n: int, g: int, smoke: bool) -> list[tuple[Variant, Tiling]]:
    """The tiled kernel at its table's tiling and one other, and (at decode) the GEMV variant, split-K."""
    problem = problem_of(kind, rows, k, n, g)
    tk = 256 if k % 256 == 0 else 128
    out = [(Variant("tiled"), default_tiling(problem, "gpu"))]
    if not smoke:  # a smoke run checks the plumbing: one tiling of each kernel
        out.append((Variant("tiled"), Tiling(16, tk, 64) if rows <= 128 else Tiling(64, 128, 128)))
    if rows <= 128 or smoke:
        split = 4
        while (k // tk) % split:
            split //= 2
        out.append((Variant("gemv", split=split), Tiling(16, tk, 64 if not smoke else 32)))
    unique = list(dict.fromkeys(out))
    return [(v, t) for v, t in unique if variant_fits(problem, v, t)]


def run_moe(kind: str, m: int, k: int, n: int, x, sizes, layers, repeats: int, smoke: bool, per_layer_us,
            tolerance: float) -> list[dict]:
    """Every grouped candidate of one expert kind at m tokens: time, error against the reference, or the error."""
    rows, g = x.shape[0], int(sizes.shape[0])

    def call(x, layer, **kw):
        rhs, scale = layer
        return grouped_matmul(x, rhs, sizes, transpose_rhs=True, rhs_scale=scale, preferred_element_type=BF16, **kw)

    want = np.asarray(call(x, layers[0], backend="xla"), np.float32)
    out = []
    for variant, tiling in candidates(kind, rows, k, n, g, smoke):
        row = {"format": kind, "op": f"grouped_matmul/{rhs_kind(kind)}", "tokens": m, "m": rows, "k": k, "n": n,
               "variant": variant.as_json(), "tiling": [tiling.tm, tiling.tk, tiling.tn]}
        try:
            def step(x, layer, variant=variant, tiling=tiling):
                return call(x, layer, backend="gpu", tiling=(tiling.tm, tiling.tk, tiling.tn),
                            variant=None if variant.name == "tiled" else variant)
            row["us"], got = per_layer_us(step, x, layers, repeats)
            got = np.asarray(got, np.float32)
            row["rel_err"] = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
            row["ok"] = row["rel_err"] <= tolerance
        except Exception as e:  # recorded, never a winner
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        out.append(row)
    return out


def bf16_ragged_dot_us(x, sizes, g: int, k: int, n: int, layers_n: int, key, repeats: int, per_layer_us) -> float:
    """bf16 XLA's ragged_dot of the same rows and routing on bf16 experts [G, K, N], per layer."""
    layers = [jax.random.normal(jax.random.fold_in(key, i), (g, k, n), BF16) for i in range(layers_n)]
    return per_layer_us(lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
                        .astype(BF16), x, layers, repeats)[0]
