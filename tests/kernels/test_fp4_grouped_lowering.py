"""The FP4 grouped (MoE) kernels at every entry of the tile tables build a Triton (GPU) and a Mosaic (TPU) module
that MLIR's verifier accepts, through the public entry point, as a real device compiler would receive it, and so
does the Triton GEMV variant; NVFP4 (groups of 16, a global scale per expert) and MXFP4 (groups of 32) each
(conftest installs mlir_verify; each test checks the verifier saw a module of the right dialect)."""

import functools

import jax
import jax.numpy as jnp
import pytest

import mlir_verify
from qconvert.kernels import Variant, fp4_grouped_matmul
from qconvert.kernels import gpu_grouped_decode
from qconvert.kernels.tile_tables import REGIMES, TILE_TABLES
from qconvert.kernels.tiles import Tiling

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
PLATFORM = {"tpu": ("tpu", "mosaic"), "gpu": ("cuda", "triton")}
# Per regime: the rows of a layer's experts (two tokens times top 8; many), and Qwen3-30B-A3B's widths:
# gate/up at decode (K = hidden 2048, N = expert width 768), down at prefill (K = 768, N = 2048).
SIZES = {"decode": (16, 2048, 768), "prefill": (600, 768, 2048)}
EXPERTS, LOCAL = 8, 6  # a shard of six experts from expert 2, as expert parallelism runs them


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_fp4_grouped_kernel_lowers_to_a_verified_module_at_its_tile_table_entry(backend, regime, group):
    m, k, n = SIZES[regime]
    platform, dialect = PLATFORM[backend]
    plans = []

    def traced(x, codes, scale, w_global, sizes):
        y, plan = fp4_grouped_matmul(x, codes, scale, sizes, group_size=group,
                                     w_global=w_global if group == 16 else None, group_offset=EXPERTS - LOCAL,
                                     preferred_element_type=BF16, backend=backend, return_plan=True)
        plans.append(plan)
        return y

    shapes = (S((m, k), BF16), S((LOCAL, n, k), jnp.uint8), S((LOCAL, n, k // group), jnp.float32),
              S((LOCAL,), jnp.float32), S((EXPERTS,), jnp.int32))
    before = mlir_verify.verified[dialect]
    text = jax.jit(traced).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    (plan,) = plans
    assert plan.fallback_reason is None and plan.backend == backend and plan.op == "grouped_matmul"
    assert plan.tile_table == f"{backend}/{regime}" and plan.variant is None
    assert plan.tiling.tm <= TILE_TABLES[(backend, regime)][plan.op].tm
    assert plan.tiling.tk % group == 0  # K tiles hold whole groups
    assert mlir_verify.verified[dialect] > before, f"no {dialect} module reached the verifier"
    assert ("tpu_custom_call" if backend == "tpu" else "triton") in text


def test_fp4_gemv_variant_lowers_for_cuda_through_the_verifier():
    before = mlir_verify.verified["triton"]
    fn = functools.partial(gpu_grouped_decode.grouped_gemv_partials, fmt_name="fp4", tiling=Tiling(16, 256, 64),
                           split=4)
    # 8 experts [768, 2048] as E2M1 code pairs, NVFP4's 128 groups of 16 per row
    jax.jit(fn).trace(S((16,), jnp.int32), (S((16, 1024), BF16),) * 2, S((8, 768, 1024), jnp.int8),
                      S((8, 768, 128), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert mlir_verify.verified["triton"] - before == 1


def test_fp4_gemv_variant_lowers_through_the_public_entry():
    plans = []

    def traced(x, codes, scale, sizes):
        y, plan = fp4_grouped_matmul(x, codes, scale, sizes, group_size=32, preferred_element_type=BF16,
                                     backend="gpu", variant=Variant("gemv", split=2), return_plan=True)
        plans.append(plan)
        return y

    before = mlir_verify.verified["triton"]
    jax.jit(traced).trace(S((8, 2048), BF16), S((EXPERTS, 768, 2048), jnp.uint8),
                          S((EXPERTS, 768, 64), jnp.float32), S((EXPERTS,), jnp.int32)
                          ).lower(lowering_platforms=("cuda",))
    assert plans[0].variant.name == "gemv" and mlir_verify.verified["triton"] > before
