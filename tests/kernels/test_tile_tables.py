"""Every kernel at every entry of the tile tables builds a Triton (GPU) and a Mosaic (TPU) module that
MLIR's verifier accepts, through the public entry points, as a real device compiler would receive it.

Interpret mode and a bare CPU lowering accept modules a device refuses; conftest
installs mlir_verify, so each lowering below is verified, and the tests check
that the verifier really saw a module of the right dialect.
"""

import jax
import jax.numpy as jnp
import pytest

import mlir_verify
from qconvert.formats import QArray
from qconvert.kernels import (fp8_matmul, grouped_matmul, int4_weight_matmul, int8_matmul, int8_weight_matmul,
                              nf4_matmul, transposed_grouped_matmul)
from qconvert.kernels.tile_tables import REGIMES, TILE_TABLES

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
PLATFORM = {"tpu": ("tpu", "mosaic"), "gpu": ("cuda", "triton")}
# Per regime: M rows, and a K whose tiles are odd multiples of 256 (576 -> 768) or long (4864).
SIZES = {"decode": (3, 576, 200), "prefill": (300, 4864, 384)}
EXPERTS = 4
F8 = jnp.float8_e4m3fn
CASES = ["int8_matmul", "fp8_matmul", "int8_weight_matmul", "nf4_matmul", "int4_weight_matmul", "int4_weight_matmul_per_channel",
         "grouped_float", "grouped_float_transposed", "grouped_int8", "grouped_fp8", "grouped_nf4", "grouped_int4",
         "grouped_int4_per_channel", "transposed_grouped_matmul"]
INT4_GROUP = 32  # divides every K of SIZES; the per-channel cases take one scale per row


def case_call(case: str, m: int, k: int, n: int, backend: str):
    """(function of traced operands returning (y, plan), the operands' shapes) for one kernel case."""
    g = EXPERTS
    sizes = S((g,), jnp.int32)
    if case == "int8_matmul":
        return (lambda x, w, xs, ws: int8_matmul(x, w, xs, ws, out_dtype=BF16, backend=backend, return_plan=True),
                (S((m, k), jnp.int8), S((n, k), jnp.int8), S((m,), jnp.float32), S((n,), jnp.float32)))
    if case == "fp8_matmul":
        return (lambda x, w, xs, ws, b: fp8_matmul(x, w, xs, ws, bias=b, out_dtype=BF16, backend=backend,
                                                   return_plan=True),
                (S((m, k), F8), S((n, k), F8), S((m,), jnp.float32), S((n,), BF16), S((n,), BF16)))
    if case == "int8_weight_matmul":
        return (lambda x, w, ws: int8_weight_matmul(x, w, ws, out_dtype=BF16, backend=backend, return_plan=True),
                (S((m, k), BF16), S((n, k), jnp.int8), S((n,), jnp.float32)))
    if case == "nf4_matmul":
        return (lambda x, w, a: nf4_matmul(x, w, a, shape=(n, k), out_dtype=BF16, backend=backend,
                                           return_plan=True),
                (S((m, k), BF16), S((n * k // 2,), jnp.uint8), S((n * k // 64,), jnp.float32)))
    if case.startswith("int4_weight_matmul"):
        group = None if case.endswith("per_channel") else INT4_GROUP
        return (lambda x, w, s: int4_weight_matmul(x, w, s, group_size=group, out_dtype=BF16, backend=backend,
                                                   return_plan=True),
                (S((m, k), BF16), S((n, k), jnp.int8), S((n, 1 if group is None else k // group), BF16)))
    if case.startswith("grouped_int4"):
        # two local experts of four, as for NF4
        group = None if case.endswith("per_channel") else INT4_GROUP
        return (lambda x, w, s, gs: grouped_matmul(
                    x, QArray(w, s, kind="int4", block_size=group, shape=(2, n, k), dtype="bfloat16"), gs,
                    transpose_rhs=True, preferred_element_type=BF16, group_offset=1, backend=backend,
                    return_plan=True),
                (S((m, k), BF16), S((2, n, k), jnp.int8), S((2, n, 1 if group is None else k // group), BF16), sizes))
    if case in ("grouped_float", "grouped_float_transposed"):
        transposed = case.endswith("transposed")
        return (lambda x, w, gs: grouped_matmul(x, w, gs, transpose_rhs=transposed, preferred_element_type=BF16,
                                                backend=backend, return_plan=True),
                (S((m, k), BF16), S((g, n, k) if transposed else (g, k, n), BF16), sizes))
    if case == "grouped_int8":
        return (lambda x, w, s, gs: grouped_matmul(x, QArray(w, s, kind="int8", shape=(g, n, k), dtype="bfloat16"),
                                                   gs, transpose_rhs=True, preferred_element_type=BF16,
                                                   group_offset=0, backend=backend, return_plan=True),
                (S((m, k), BF16), S((g, n, k), jnp.int8), S((g, n, 1), jnp.float32), sizes))
    if case == "grouped_fp8":
        # E4M3 experts, two local of four; rows as float32 values (qgrouped_linear's fake-quantized E4M3 rows)
        return (lambda x, w, s, gs: grouped_matmul(x, QArray(w, s, kind="fp8", shape=(2, n, k), dtype="bfloat16"),
                                                   gs, transpose_rhs=True, preferred_element_type=BF16,
                                                   group_offset=1, backend=backend, return_plan=True),
                (S((m, k), jnp.float32), S((2, n, k), F8), S((2, n, 1), BF16), sizes))
    if case == "grouped_nf4":
        # two local experts of four (a shard), as expert parallelism runs them
        return (lambda x, w, a, gs: grouped_matmul(
                    x, QArray(w, a, kind="nf4", block_size=64, shape=(2, n, k), dtype="bfloat16"), gs,
                    transpose_rhs=True, preferred_element_type=BF16, group_offset=1, backend=backend,
                    return_plan=True),
                (S((m, k), BF16), S((2 * n * k // 2,), jnp.uint8), S((2 * n * k // 64,), jnp.float32), sizes))
    return (lambda x, y, gs: transposed_grouped_matmul(x, y, gs, backend=backend, return_plan=True),
            (S((k, m), BF16), S((m, n), BF16), sizes))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_kernel_lowers_to_a_verified_module_at_its_tile_table_entry(backend, regime, case):
    m, k, n = SIZES[regime]
    platform, dialect = PLATFORM[backend]
    fn, shapes = case_call(case, m, k, n, backend)
    plans = []

    def traced(*operands):
        y, plan = fn(*operands)
        plans.append(plan)
        return y

    before = mlir_verify.verified[dialect]
    text = jax.jit(traced).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    (plan,) = plans
    expected_regime = "prefill" if case == "transposed_grouped_matmul" else regime
    assert plan.fallback_reason is None and plan.backend == backend
    assert plan.tile_table == f"{backend}/{expected_regime}"
    assert plan.tiling.tm <= TILE_TABLES[(backend, expected_regime)][plan.op].tm
    assert mlir_verify.verified[dialect] > before, f"no {dialect} module reached the verifier"
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


def test_every_operation_has_an_entry_in_every_table():
    ops = {"int8_matmul", "fp8_matmul", "int8_weight_matmul", "nf4_matmul", "int4_weight_matmul", "fp4_weight_matmul",
           "grouped_matmul", "transposed_grouped_matmul"}
    assert set(TILE_TABLES) == {(b, r) for b in ("tpu", "gpu") for r in REGIMES}
    assert all(set(table) == ops for table in TILE_TABLES.values())
    # the two backends tile differently: Triton's power-of-two tiles are not Mosaic's (8, 128) vreg tiles
    assert TILE_TABLES[("gpu", "decode")] != TILE_TABLES[("tpu", "decode")]
