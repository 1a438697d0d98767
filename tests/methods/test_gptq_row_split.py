"""One GPTQ group's rows split over the devices: which groups are split, the blocks of rows, and a Llama whose
down_proj is split over 2 processes x 2 forced CPU devices writing the bytes of one device (the real runtime,
jax.distributed on 127.0.0.1); the rows split over 4 devices of one process give one device's codes on the int4,
int4-asym and fp8 grids, and the float64 reference's."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import tree
from cluster_helpers import command, env, free_port
from qconvert.methods.gptq_rows import MIN_ROWS_A_DEVICE, row_blocks, split_groups

CALIB = ["--calib", "random", "--calib-samples", "16", "--calib-seqlen", "32"]
HIDDEN, INTERMEDIATE = 256, 512  # down_proj: 256 rows, 64 a device over 4


def _group_costs(hidden: int, intermediate: int, kv: int) -> tuple[list[float], list[int]]:
    """A Llama layer's GPTQ groups (q/k/v, o, gate/up, down) as gptq._cost counts them: rows in^2 + in^3."""
    groups = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    return [float(rows * width ** 2 + width ** 3) for rows, width in groups], [rows for rows, _ in groups]


def test_a_group_is_split_while_kept_whole_it_would_hold_its_device_up():
    costs, rows = _group_costs(HIDDEN, INTERMEDIATE, HIDDEN // 2)
    assert costs[3] > sum(costs) / 4 and costs[2] > sum(costs[:3]) / 4  # down_proj's, then gate/up's, ...
    assert split_groups(costs, rows, 4) == [True, True, True, True]
    assert split_groups(costs, rows, 1) == [False] * 4
    # 8 devices: down_proj's 256 rows are too few for MIN_ROWS_A_DEVICE each; q/k/v's (512 rows) and gate/up's
    # (1024) are split; o_proj's (256) stays whole
    assert HIDDEN < 8 * MIN_ROWS_A_DEVICE <= 2 * HIDDEN
    assert split_groups(costs, rows, 8) == [True, False, True, False]
    # Llama-3-8B on 8 devices: every group; a MoE layer's many experts' groups stay whole (an even spread)
    assert split_groups(*_group_costs(4096, 14336, 1024), 8) == [True] * 4
    experts = [(2 * 768, 2048)] * 128 + [(2048, 768)] * 128  # Qwen3-30B-A3B's experts
    assert not any(split_groups([float(r * w * w + w ** 3) for r, w in experts], [r for r, _ in experts], 8))


def test_row_blocks_cover_the_rows_in_order():
    blocks = row_blocks(10, 4)
    assert [(b.start, b.stop) for b in blocks] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [(b.start, b.stop) for b in row_blocks(256, 4)] == [(0, 64), (64, 128), (128, 192), (192, 256)]


SPLIT_SCRIPT = textwrap.dedent("""
    import sys, json
    import numpy as np, jax, jax.numpy as jnp
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from test_gptq_core import reference_gptq, int_round
    from qconvert.formats.layout_base import LayoutFlags
    from qconvert.methods.gptq_core import hessian_factor, round_columns
    from qconvert.methods.gptq_rows import round_rows
    from qconvert.schemes import scheme_named

    assert len(jax.devices()) == 4
    rng = np.random.default_rng(0)
    rows, n = 264, 384  # 66 rows a device
    w = (rng.standard_normal((rows, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((2 * n, n)).astype(np.float32) @ (np.eye(n) + 0.01 * rng.standard_normal((n, n)))
    x = x.astype(np.float32)
    h = (2.0 / x.shape[0]) * (x.T @ x)
    out = {}
    for name, flags in [("int4", LayoutFlags(group_size=128)), ("int4-asym", LayoutFlags(group_size=128)),
                        ("fp8", LayoutFlags())]:
        scheme = scheme_named(name)
        q = scheme.quantize(w, flags, scale_dtype=np.float32)
        steps, offsets = np.asarray(scheme.gptq_steps(q, flags)), scheme.gptq_offsets(q, flags)
        offsets = None if offsets is None else np.asarray(offsets)
        factor = hessian_factor(jnp.asarray(h), 0.1, act_order=True)
        grid = scheme.gptq_grid()
        with jax.default_device(jax.devices()[0]):
            whole = round_columns(w, steps, *factor, grid=grid, offsets=offsets)
        split = round_rows(w, steps, offsets, factor, grid=grid, block_size=128)
        same = [bool(np.array_equal(np.asarray(a) + 0, np.asarray(b) + 0)) for a, b in zip(whole, split)]
        entry = {"codes": same[0], "values": same[1]}
        if name == "int4":  # the float64 reference (the paper's loop), on the same steps
            rounding = int_round(-8, 7)
            expected = reference_gptq(w, h, steps, rounding, damp=0.1, act_order=True)
            got = np.asarray(split[0], np.float64)
            entry["reference"] = float(np.mean(got == expected))
        out[name] = entry
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_rows_split_over_four_devices_round_as_one_device(tmp_path):
    """The integer grid, with zero points, and fp8 (its signed zeros): the codes and values of the rows rounded 66
    a device are one device's, bit for bit (each row's sums run over columns only), and the codes agree with the
    float64 reference (ties of float32 aside)."""
    import json

    script = tmp_path / "split.py"
    script.write_text(SPLIT_SCRIPT)
    paths = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # test_gptq_core's folder, tests/
    done = subprocess.run([sys.executable, str(script), *paths], env=env(4), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert set(result) == {"int4", "int4-asym", "fp8"}
    for name, entry in result.items():
        assert entry["codes"] and entry["values"], name
        if "reference" in entry:
            assert entry["reference"] > 0.99, (name, entry)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--scheme", "int4", "--no-awq"], ["--scheme", "w8a8", "--gptq"]],
                         ids=["int4-gptq", "w8a8-smoothed-gptq"])
def test_groups_split_over_two_processes_of_two_devices_write_the_bytes_of_one_device(flags, tmp_path):
    """Every group of the layer is split on 4 devices (test_a_group_is_split_...): int4, and w8a8 whose GPTQ
    rounds the smoothed weights on the smoothed Hessians."""
    source = tmp_path / "llama"
    make_llama_checkpoint(source, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=4, kv_heads=2, layers=2,
                          dtype="bfloat16", outlier_channels=(3, 17))
    args = ["quantize", str(source), *flags, *CALIB, "-q"]
    alone = subprocess.run(command([*args, "-o", str(tmp_path / "one")]), env=env(1), capture_output=True,
                           text=True, timeout=600)
    assert alone.returncode == 0, alone.stderr
    port = free_port()
    procs = [subprocess.Popen(command([*args, "-o", str(tmp_path / "two"), "--coordinator", f"127.0.0.1:{port}",
                                        "--num-processes", "2", "--process-id", str(i)]),
                              env=env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for err in errs]
    assert tree(tmp_path / "two") == tree(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama", "one", "two"]
