"""The calibration memory estimate against a measured peak, and the batch size it fits to a budget."""

import json
import subprocess
import sys
import textwrap

import pytest

from checkpoints import make_llama_checkpoint
from cli_helpers import PEAK_RSS_BYTES

from qconvert.calibration.memory import RUNTIME_BYTES, ModelShapes, checkpoint_shapes, estimate, fit_batch_size
from qconvert.calibration.observer import open_params
from qconvert.models import build

_MEASURE = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from qconvert.calibration.data import random_windows
    from qconvert.calibration.observer import iter_layer_stats, open_params
    from qconvert.models import build

    folder, samples, seqlen, batch = sys.argv[1], *map(int, sys.argv[2:5])
    config = json.load(open(folder + "/config.json"))
    model, params = build(config), open_params(folder)
    ids = random_windows(int(config["vocab_size"]), samples, seqlen, seed=0)
    (jnp.ones(4) + 1).block_until_ready()  # the runtime started before the baseline is taken
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * 4096
    keep = {m for i in range(model.num_layers) for m in model.layer_linears(i)}
    for layer in iter_layer_stats(model, params, ids, batch_size=batch, keep_inputs=keep):
        pass
    peak = PEAK_RSS_BYTES
    print(json.dumps({"growth": peak - before}))
""").replace("PEAK_RSS_BYTES", PEAK_RSS_BYTES)


def _measure(folder, samples, seqlen, batch) -> int:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), str(samples), str(seqlen), str(batch)],
                          capture_output=True, text=True, timeout=600, env={"JAX_PLATFORMS": "cpu",
                                                                              "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["growth"]


    shapes = checkpoint_shapes(model, open_params(folder))
    for samples, seqlen, batch in ((32, 512, 8), (16, 256, 16)):
        want = estimate(shapes, samples, seqlen, batch)
        measured = _measure(folder, samples, seqlen, batch)
        assert measured <= want.total_on_cpu(), (samples, seqlen, batch, measured, want)
        # ... and it is a bound of the arrays, not of the runtime alone: they are most of the measure.
        assert want.device_bytes + want.host_bytes >= 0.5 * (measured - RUNTIME_BYTES), (measured, want)


def test_a_childs_peak_is_its_own_not_its_parents():
    # The measure above runs in a child of the pytest process, which holds gigabytes late in the suite: a peak
    # that counted the parent's would let any estimate pass there (getrusage's ru_maxrss does).
    held = bytearray(1 << 30)
    held[::4096] = b"\1" * len(held[::4096])
    code = f"import resource; print({PEAK_RSS_BYTES}, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    own, rusage = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          check=True).stdout.split())
    assert own < 200 * 2**20 <= (1 << 30) <= rusage, (own, rusage)
    del held


def test_estimate_by_hand():
    shapes = ModelShapes(hidden=8, heads=2, layer_bytes=1000, layer_elements=500, layer_width=40,
                         embed_bytes=300, embed_elements=150, head_bytes=200, layer_inputs=24)
    got = estimate(shapes, samples=4, seqlen=3, batch_size=2, sample_rows=5)
    hidden = 4 * 3 * 8 * 4                                # 384
    batch = 2 * (2 * 3 * 4 * (40 + 16) + 2 * 2 * 2 * 3 * 3 * 4)  # two batches of 1344 + 288
    assert got.batch_bytes == batch
    assert got.device_bytes == 3 * hidden + 1000 + 500 * 4 + batch
    assert got.host_bytes == 1000 + 5 * 24 * 4


def test_fit_batch_size_shrinks_the_batch_to_the_budget():
    shapes = ModelShapes(hidden=576, heads=9, layer_bytes=2 * 10**7, layer_elements=10**7, layer_width=10000,
                         embed_bytes=5 * 10**7, embed_elements=2.5 * 10**7, head_bytes=10**6, layer_inputs=5000)
    full = estimate(shapes, 64, 512, 8).device_bytes
    assert fit_batch_size(shapes, 64, 512, 8, budget=full) == 8
    four = estimate(shapes, 64, 512, 4).device_bytes
    assert fit_batch_size(shapes, 64, 512, 8, budget=four + 1) == 4
    assert fit_batch_size(shapes, 64, 512, 8, budget=1) == 1


def test_gptq_adds_the_hessians_and_a_fourth_copy_of_the_hidden_states_by_hand():
    shapes = ModelShapes(hidden=8, heads=2, layer_bytes=1000, layer_elements=500, layer_width=40,
                         embed_bytes=300, embed_elements=150, head_bytes=200, layer_inputs=24,
                         hessian_elements=3 * 8 * 8 + 16 * 16, largest_linear=16 * (16 + 8))
    plain = estimate(shapes, samples=4, seqlen=3, batch_size=2, sample_rows=5)
    gptq = estimate(shapes, samples=4, seqlen=3, batch_size=2, sample_rows=5, hessians=True, sequential=True)
    hidden = 4 * 3 * 8 * 4
    # each linear's running sum and one batch's product, float32; four [in, in + out] matrices of the
    # largest linear while it is rounded; the layer's input kept beside its two outputs
    assert gptq.device_bytes - plain.device_bytes == 2 * 4 * (3 * 64 + 256) + 4 * 4 * 16 * 24 + hidden


def test_split_over_devices_each_adds_the_blocks_of_the_hessians_it_sums_by_hand():
    shapes = ModelShapes(hidden=8, heads=2, layer_bytes=1000, layer_elements=500, layer_width=40,
                         embed_bytes=300, embed_elements=150, head_bytes=200, layer_inputs=24,
                         hessian_elements=3 * 8 * 8 + 16 * 16, largest_linear=16 * (16 + 8))
    one = estimate(shapes, samples=4, seqlen=3, batch_size=2, hessians=True, sequential=True)
    four = estimate(shapes, samples=4, seqlen=3, batch_size=2, hessians=True, sequential=True, devices=4)
    # beside its batch's product and the received blocks: its block of the running sum, before and after
    assert four.device_bytes - one.device_bytes == 2 * (448 * 4) // 4


def test_a_70b_down_proj_hessian_lowers_the_batch():
    # Llama-70B's down_proj reads 28672 features: its Hessian alone is 28672^2 float32 (3.3 GB).
    shapes = ModelShapes(hidden=8192, heads=64, layer_bytes=2 * 856 * 10**6, layer_elements=856 * 10**6,
                         layer_width=200000, embed_bytes=2 * 10**9, embed_elements=10**9, head_bytes=2 * 10**9,
                         layer_inputs=80000, hessian_elements=28672**2 + 3 * 8192**2,
                         largest_linear=28672 * (28672 + 8192))
    budget = estimate(shapes, 128, 512, 8).device_bytes
    assert fit_batch_size(shapes, 128, 512, 8, budget) == 8
    assert fit_batch_size(shapes, 128, 512, 8, budget, hessians=True, sequential=True) < 8


def test_a_device_that_cannot_hold_even_one_window_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """A device that states its memory (a GPU, a TPU) and cannot hold the calibration at batch size 1: one line,
    exit 2, nothing written (a CPU states none and is never refused here)."""
    from cli_helpers import run, tree
    from qconvert.calibration import observer

    folder = make_llama_checkpoint(tmp_path / "src")
    shapes = checkpoint_shapes(build(json.loads((folder / "config.json").read_text())), open_params(folder))
    need = estimate(shapes, 16, 32, 1, hessians=True, sequential=True).device_bytes
    monkeypatch.setattr(observer, "device_budget", lambda device: need - 1)
    before = tree(tmp_path)
    code, out, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "int4", "--calib",
                          "random", "--calib-samples", "16", "--calib-seqlen", "32"], capsys)
    assert code == 2
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("qconvert: error: calibrating on 16 x 32 tokens needs about ")
    assert "GiB on each device even one window at a time" in line
    assert "--calib-samples" in line
    assert tree(tmp_path) == before
    monkeypatch.setattr(observer, "device_budget", lambda device: need)  # exactly enough: it runs
    code, _, err = run(["quantize", str(folder), "-o", str(tmp_path / "out"), "--scheme", "int4", "--calib",
                        "random", "--calib-samples", "16", "--calib-seqlen", "32", "-q"], capsys)
    assert code == 0, err


def _moe_shapes():
    # A layer of 4 experts (each projection 16 x 8 / 8 x 16) beside 400 bytes of other tensors.
    return ModelShapes(hidden=8, heads=2, layer_bytes=1000, layer_elements=500, layer_width=40,
                       embed_bytes=300, embed_elements=150, head_bytes=200, layer_inputs=24,
                       hessian_elements=3 * 8 * 8 + 4 * (2 * 8 * 8 + 16 * 16), largest_linear=16 * (16 + 8),
                       experts=4, expert_bytes=600, expert_elements=300,
                       expert_hessian_elements=4 * (2 * 8 * 8 + 16 * 16), routed_width=2 * 3 * (16 + 8))


def test_experts_split_over_devices_by_hand():
    shapes = _moe_shapes()
    whole = estimate(shapes, samples=4, seqlen=3, batch_size=2, hessians=True, sequential=True, devices=4)
    split = estimate(shapes, samples=4, seqlen=3, batch_size=2, hessians=True, sequential=True, devices=4,
                     experts_split=True)
    # each device: one of the 4 experts (stored and float32), its Hessians (sum and one batch's product) instead
    # of every expert's as the dense linears' (2 + 2/4 copies), and every device's routed rows (two batches)
    weights = 600 * 3 / 4 + 300 * 3 / 4 * 4
    hessians = (2 + 2 / 4) * 1536 * 4 - 2 * (1 / 4) * 1536 * 4
    rows = 2 * 4 * 2 * 3 * 144 * 4
    assert whole.device_bytes - split.device_bytes == int(weights + hessians - rows)
    assert split.host_bytes - whole.host_bytes == 600  # the experts stacked for placing
    # one device: nothing to split over
    assert estimate(shapes, 4, 3, 2, experts_split=True) == estimate(shapes, 4, 3, 2)


def test_experts_are_split_where_the_whole_layer_does_not_fit_and_refused_where_even_split_does_not():
    from qconvert.calibration.memory import check_fits, split_experts
    from qconvert.formats.errors import UsageError

    shapes = _moe_shapes()
    whole = estimate(shapes, 4, 1, 1, hessians=True, devices=4).device_bytes
    split = estimate(shapes, 4, 1, 1, hessians=True, devices=4, experts_split=True).device_bytes
    assert split < whole
    assert not split_experts(shapes, 4, 1, whole, devices=4, hessians=True)   # fits with every expert
    assert split_experts(shapes, 4, 1, whole - 1, devices=4, hessians=True)
    assert not split_experts(shapes, 4, 1, whole - 1, devices=1, hessians=True)  # one device: nowhere to split
    assert not split_experts(shapes, 4, 1, None, devices=4, hessians=True)      # a CPU states no limit
    dense = ModelShapes(**{**shapes.__dict__, "experts": 0, "expert_bytes": 0, "expert_elements": 0,
                           "expert_hessian_elements": 0, "routed_width": 0})
    assert not split_experts(dense, 4, 1, 1, devices=4, hessians=True)
    check_fits(shapes, 4, 1, split, hessians=True, devices=4, experts_split=True)
    with pytest.raises(UsageError, match="GiB on each device with the experts split over 4 devices even one "
                                         "window at a time"):
        check_fits(shapes, 4, 1, split - 1, hessians=True, devices=4, experts_split=True)


def test_a_moe_checkpoints_shapes_name_its_experts(tmp_path):
    from checkpoints import make_mixtral_checkpoint

    folder = make_mixtral_checkpoint(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    shapes = checkpoint_shapes(build(config), open_params(folder))
    hidden, inter, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    assert shapes.experts == experts
    assert shapes.expert_elements == experts * 3 * hidden * inter
    assert shapes.expert_hessian_elements == experts * (2 * hidden**2 + inter**2)
    assert shapes.routed_width == config["num_experts_per_tok"] * 3 * (hidden + inter)
