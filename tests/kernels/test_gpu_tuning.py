"""bench/gpu_tune.py end to end on a CPU (--smoke: interpret mode, tiny shapes): each candidate checked against
the reference and timed, the winners written as a tuned table the plans then read, a budget cut-off said."""

import json
import sys
from pathlib import Path

import pytest

from qconvert.kernels import KernelProblem, gpu_tuning, plan as plan_module, select_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_tune  # noqa: E402


def test_smoke_sweep_writes_a_table_the_plans_read(tmp_path, monkeypatch, capsys):
    out, table, md = tmp_path / "tune.json", tmp_path / "out" / "gpu_tuned.json", tmp_path / "tune.md"
    # M = 1: one dense shape and Qwen's experts scaled down (4 experts, top 2: 2 rows)
    assert gpu_tune.main(["--smoke", "--formats", "int4", "--m", "1", "--json", str(out),
                          "--table", str(table), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["status"].startswith("2 of 2 shapes")
    # every candidate ran in interpret mode and matched the reference (backend "xla") within the tolerance
    assert sorted((r["op"], r["m"], r["variant"]["name"]) for r in doc["candidates"]) == [
        ("grouped_matmul/int4", 2, "gemv"), ("grouped_matmul/int4", 2, "tiled"), ("int4_weight_matmul", 1, "splitk"),
        ("int4_weight_matmul", 1, "xla")]
    assert all(r["ok"] and r["rel_err"] <= 2e-2 and r["us"] > 0 for r in doc["candidates"])
    assert sorted((b["kind"], b["m"]) for b in doc["baselines"]) == [("dense", 1), ("moe", 2)]
    winners = {(w["op"], w["m"]): w for w in doc["winners"]}
    assert set(winners) == {("int4_weight_matmul", 1), ("grouped_matmul/int4", 2)}
    # the table is the file the plans read: the dense and the grouped problem take their winners
    monkeypatch.setattr(gpu_tuning, "TUNED_PATH", table)
    plan_module._select_kernel.cache_clear()
    try:
        dense = select_kernel(KernelProblem("int4_weight_matmul", 1, 256, 64, group_size=128), "gpu")
        grouped = select_kernel(KernelProblem("grouped_matmul", 2, 256, 64, num_groups=4, rhs_kind="int4",
                                              group_size=128), "gpu")
        for plan, op, m in ((dense, "int4_weight_matmul", 1), (grouped, "grouped_matmul/int4", 2)):
            assert plan.tile_table == "gpu/tuned" and plan.variant.name == winners[(op, m)]["variant"]["name"]
            assert [plan.tiling.tm, plan.tiling.tk, plan.tiling.tn] == winners[(op, m)]["tiling"]
    finally:
        plan_module._select_kernel.cache_clear()
    text = md.read_text()
    assert "2 of 2 shapes" in text and "| int4 | 1 | 256x64 |" in text
    assert "| int4 experts | 2 (1 tok) | 256x64 |" in text
    assert "4 candidates timed, 0 wrong or failed" in capsys.readouterr().out


def test_budget_cut_off_says_how_far_it_got(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert gpu_tune.main(["--smoke", "--budget", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert not doc["complete"] and doc["candidates"] == []
    assert doc["status"] == "stopped at the 0 s budget after 0 of 4 shapes; next was M=1 256x64"
    assert "stopped at the 0 s budget" in capsys.readouterr().out


def test_shapes_run_most_telling_first():
    order = gpu_tune.shape_order(gpu_tune.MS, gpu_tune.KNS, gpu_tune.gpu_tune_moe.KNS)
    assert order[:4] == [(1, (4096, 4096), False), (4096, (4096, 4096), False), (1, (4096, 14336), False),
                         (4096, (4096, 14336), False)]
    assert (1, (2048, 768), True) in order[:16]  # the experts at decode before any third M
    assert all(m in (1, 4096) for m, _, _ in order[:16])
    assert len(order) == len(set(order)) == len(gpu_tune.MS) * (len(gpu_tune.KNS) + len(gpu_tune.gpu_tune_moe.KNS))


def test_refuses_to_time_without_a_gpu(capsys):
    assert gpu_tune.main([]) == 2
    assert "not a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", gpu_tune.FORMATS)
def test_every_candidate_fits_its_shape(fmt):
    # The real sweep's candidates all pass the GPU tiling rules at every shape (none is dropped silently).
    for m in gpu_tune.MS:
        for k, n in gpu_tune.KNS:
            names = [v.name for v, _ in gpu_tune.candidates(fmt, m, k, n, smoke=False)]
            assert names[0] == "tiled" and names[-1] == "xla" and len(names) >= 3
        for k, n in gpu_tune.gpu_tune_moe.KNS:
            kind = gpu_tune.MOE_KINDS[fmt]
            names = [v.name for v, _ in gpu_tune.gpu_tune_moe.candidates(kind, 8 * m, k, n, 128, smoke=False)]
            assert names[0] == "tiled" and (("gemv" in names) == (m <= 16))
