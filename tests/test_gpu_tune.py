"""bench/gpu_tune.py end to end on a CPU (--smoke: interpret mode, tiny shapes): each candidate checked against
the reference and timed, the winners written as a tuned table the plans then read, a budget cut-off said."""

import json
import sys
from pathlib import Path

import pytest

from qconvert.kernels import KernelProblem, gpu_tuning, plan as plan_module, select_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_tune  # noqa: E402


def test_smoke_sweep_writes_a_table_the_plans_read(tmp_path, monkeypatch, capsys):
    out, table, md = tmp_path / "tune.json", tmp_path / "out" / "gpu_tuned.json", tmp_path / "tune.md"
    assert gpu_tune.main(["--smoke", "--formats", "int4", "--m", "1", "64", "--json", str(out),
                          "--table", str(table), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["status"].startswith("2 of 2 shapes")
    # every candidate ran in interpret mode and matched the reference (backend "xla") within the tolerance
    assert {(r["m"], r["variant"]["name"]) for r in doc["candidates"]} == {(1, "splitk"), (1, "xla"),
                                                                          (64, "pipelined"), (64, "xla")}
    assert all(r["ok"] and r["rel_err"] <= 2e-2 and r["us"] > 0 for r in doc["candidates"])
    assert [b["m"] for b in doc["baselines"]] == [1, 64]
    winners = {(w["m"], w["variant"]["name"]) for w in doc["winners"]}
    assert len(winners) == 2
    # the table is the file the plans read: M = 1 and M = 64 take their winners
    monkeypatch.setattr(gpu_tuning, "TUNED_PATH", table)
    plan_module._select_kernel.cache_clear()
    try:
        for m, name in winners:
            plan = select_kernel(KernelProblem("int4_weight_matmul", m, 256, 64, group_size=128), "gpu")
            assert (plan.variant.name, plan.tile_table) == (name, "gpu/tuned")
    finally:
        plan_module._select_kernel.cache_clear()
    rows = [line for line in md.read_text().splitlines() if line.startswith("| int4 |")]
    assert len(rows) == 2 and "2 of 2 shapes" in md.read_text()
    assert "4 candidates timed, 0 wrong or failed" in capsys.readouterr().out


def test_budget_cut_off_says_how_far_it_got(tmp_path, capsys):
    out = tmp_path / "tune.json"
    assert gpu_tune.main(["--smoke", "--budget", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert not doc["complete"] and doc["candidates"] == []
    assert doc["status"] == "stopped at the 0 s budget after 0 of 2 shapes; next was M=1 256x64"
    assert "stopped at the 0 s budget" in capsys.readouterr().out


def test_shapes_run_most_telling_first():
    order = gpu_tune.shape_order(gpu_tune.MS, gpu_tune.KNS)
    assert order[:4] == [(1, (4096, 4096)), (4096, (4096, 4096)), (1, (4096, 14336)), (4096, (4096, 14336))]
    assert len(order) == len(set(order)) == len(gpu_tune.MS) * len(gpu_tune.KNS)


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
