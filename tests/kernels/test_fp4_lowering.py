"""The FP4 kernels at every entry of the tile tables build a Triton (GPU) and a Mosaic (TPU) module that MLIR's
verifier accepts, through the public entry point, as a real device compiler would receive it (conftest installs
mlir_verify; each test checks the verifier saw a module of the right dialect)."""

import jax
import jax.numpy as jnp
import pytest

import mlir_verify
from qconvert.kernels.fp4 import fp4_weight_matmul
from qconvert.kernels.tile_tables import REGIMES, TILE_TABLES

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
PLATFORM = {"tpu": ("tpu", "mosaic"), "gpu": ("cuda", "triton")}
# Per regime: M rows, and a K whose tiles are odd multiples of 256 (576 -> 768) or long (4864), as for NF4.
SIZES = {"decode": (3, 576, 200), "prefill": (300, 4864, 384)}
# One lowering per entry, NVFP4 (groups of 16, a global scale) and MXFP4 (groups of 32) each on both backends.
FORMAT = {("tpu", "decode"): 16, ("tpu", "prefill"): 32, ("gpu", "decode"): 32, ("gpu", "prefill"): 16}


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_fp4_kernel_lowers_to_a_verified_module_at_its_tile_table_entry(backend, regime):
    m, k, n = SIZES[regime]
    group = FORMAT[(backend, regime)]
    platform, dialect = PLATFORM[backend]
    plans = []

    def traced(x, codes, scale, w_global, bias):
        y, plan = fp4_weight_matmul(x, codes, scale, group_size=group, w_global=w_global if group == 16 else None,
                                    bias=bias, out_dtype=BF16, backend=backend, return_plan=True)
        plans.append(plan)
        return y

    shapes = (S((m, k), BF16), S((n, k), jnp.uint8), S((n, k // group), jnp.float32), S((1, 1), jnp.float32),
              S((n,), BF16))
    before = mlir_verify.verified[dialect]
    text = jax.jit(traced).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    (plan,) = plans
    assert plan.fallback_reason is None and plan.backend == backend and plan.op == "fp4_weight_matmul"
    assert plan.tile_table == f"{backend}/{regime}"
    assert plan.tiling.tm <= TILE_TABLES[(backend, regime)][plan.op].tm
    assert plan.tiling.tk % group == 0  # K tiles hold whole groups
    assert mlir_verify.verified[dialect] > before, f"no {dialect} module reached the verifier"
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text
