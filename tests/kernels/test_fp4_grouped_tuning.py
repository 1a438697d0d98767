"""bench/gpu_tune.py's MoE sweep takes the FP4 experts (NVFP4 and MXFP4) as the grouped_matmul/fp4 entry: on a CPU
in interpret mode every candidate matches the reference, and at Qwen3-30B-A3B's shapes every candidate fits the
GPU tiling rules of both group sizes, so a GPU run can sweep them."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qconvert.kernels import KernelProblem, gpu_tuning, plan as plan_module, select_kernel
from qconvert.kernels.plan import variant_fits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_tune  # noqa: E402
import gpu_tune_moe  # noqa: E402


@pytest.mark.parametrize("kind", gpu_tune_moe.FP4_KINDS)
def test_fp4_experts_are_swept_against_the_reference_in_interpret_mode(kind):
    m, k, n, experts, top = 1, 256, 64, 4, 2
    key = jax.random.PRNGKey(3)
    sizes = gpu_tune_moe.routing(m, experts, top, key)
    x = jax.random.normal(key, (m * top, k), jnp.float32).astype(jnp.bfloat16)
    layers = [gpu_tune_moe.expert_weights(kind, experts, n, k, jax.random.fold_in(key, 1))]
    with gpu_tune.interpreted():
        rows = gpu_tune_moe.run_moe(kind, m, k, n, x, sizes, layers, 1, True, gpu_tune.per_layer_us,
                                    gpu_tune.TOLERANCE)
    assert sorted(r["variant"]["name"] for r in rows) == ["gemv", "tiled"]
    assert all(r["op"] == "grouped_matmul/fp4" and r["format"] == kind for r in rows)
    assert all(r["ok"] and r["rel_err"] <= gpu_tune.TOLERANCE and r["us"] > 0 for r in rows), rows


def test_the_swept_weights_are_the_formats_own():
    q = gpu_tune_moe.expert_weights("nvfp4", 3, 8, 64, jax.random.PRNGKey(0))[0]
    scale = np.asarray(q.scale)
    # E4M3 group scales of 16 columns, a float32 global scale per expert
    assert q.block_size == 16 and scale.shape == (3, 8, 4) and np.asarray(q.zero_point).shape == (3, 1, 1)
    assert np.array_equal(scale, scale.astype(jnp.float8_e4m3fn).astype(np.float32))
    q = gpu_tune_moe.expert_weights("mxfp4", 3, 8, 64, jax.random.PRNGKey(0))[0]
    exponents = np.log2(np.asarray(q.scale))
    assert q.block_size == 32 and q.zero_point is None and np.array_equal(exponents, np.round(exponents))


@pytest.mark.parametrize("kind", gpu_tune_moe.FP4_KINDS)
def test_every_fp4_candidate_fits_its_shape_for_both_group_sizes(kind):
    # a winner is written as the one grouped_matmul/fp4 entry, which NVFP4 and MXFP4 experts both then read
    for m in gpu_tune.MS:
        for k, n in gpu_tune_moe.KNS:
            found = gpu_tune_moe.candidates(kind, 8 * m, k, n, 128, smoke=False)
            names = [v.name for v, _ in found]
            assert names[0] == "tiled" and (("gemv" in names) == (m <= 16))
            for other in gpu_tune_moe.FP4_KINDS:
                problem = gpu_tune_moe.problem_of(other, 8 * m, k, n, 128)
                assert all(variant_fits(problem, v, t) for v, t in found)


def test_a_tuned_fp4_entry_is_what_the_plans_read(tmp_path, monkeypatch):
    table = tmp_path / "gpu_tuned.json"
    entry = {"op": "grouped_matmul/fp4", "m": 16, "k": 2048, "n": 768, "variant": {"name": "gemv", "split": 2},
             "tiling": [16, 256, 32], "us": 1.0}
    gpu_tuning.write_tuned(table, "a GPU", [entry])
    monkeypatch.setattr(gpu_tuning, "TUNED_PATH", table)
    plan_module._select_kernel.cache_clear()
    try:
        for group in (16, 32):
            plan = select_kernel(KernelProblem("grouped_matmul", 16, 2048, 768, num_groups=128, rhs_kind="fp4",
                                               group_size=group), "gpu")
            assert plan.tile_table == "gpu/tuned" and plan.variant.name == "gemv"
            assert [plan.tiling.tm, plan.tiling.tk, plan.tiling.tn] == [16, 256, 32]
    finally:
        plan_module._select_kernel.cache_clear()
