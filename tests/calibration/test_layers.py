"""Calibration's layer programs: one compile per layer signature, and data parallel over devices."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.calibration.statistics import InputHessian
import pytest
from checkpoints import make_llama_checkpoint, make_mixtral_checkpoint

from qconvert.calibration.data import random_windows
from qconvert.calibration.observer import iter_layer_stats, open_params
from qconvert.calibration.statistics import InputAbsMax, InputHessian, KeptRows
from qconvert.models import build
from qconvert.calibration.layers import iterate_layers
from qconvert.calibration.layers import layer_signature


class CountingModel:
    """A model whose `layer` counts how often it is called: under jit, once per trace."""

    def __init__(self, model):
        self.model = model
        self.traces = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def layer(self, *args, **kwargs):
        self.traces += 1
        return self.model.layer(*args, **kwargs)


def _windowed_llama(folder: Path) -> tuple[Path, dict]:
    """A 5-layer Qwen2 (the Llama decoder with Qwen's window layout): layers 0-2 full attention, 3-4 a sliding
    window of 3 tokens."""
    folder = make_llama_checkpoint(folder, layers=5, outlier_channels=(3,), architecture="Qwen2ForCausalLM")
    config = json.loads((folder / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=3, max_window_layers=3)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, config


def test_layers_of_one_signature_share_one_program(tmp_path):
    folder, config = _windowed_llama(tmp_path / "m")
    params = open_params(folder)
    ids = random_windows(256, 4, 8, seed=1)
    model = CountingModel(build(config))
    assert model.args.sliding_windows == (None, None, None, 3, 3)
    signatures = {layer_signature(model, i) for i in range(model.num_layers)}
    assert len(signatures) == 2

    def observe(name, x, valid):
        return jnp.max(jnp.abs(x), axis=tuple(range(x.ndim - 1)))

    shared = list(iterate_layers(model, params, ids, observe=observe, batch_size=2))
    assert model.traces == len(signatures)  # not one per layer (5)

    separate_model = CountingModel(build(config))
    separate = list(iterate_layers(separate_model, params, ids, observe=observe, batch_size=2,
                                   share_programs=False))
    assert separate_model.traces == 5
    for a, b in zip(shared, separate):
        # Each layer's names come back as its own, with the same values as its own program gives.
        assert sorted(a.observed) == sorted(b.observed) == sorted(model.layer_linears(a.index))
        for name in a.observed:
            for x, y in zip(a.observed[name], b.observed[name]):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(a.hidden), np.asarray(b.hidden))

    # Independent of both: the whole model's eager forward (the window applied per layer).
    with jax.disable_jit():
        hidden = model.embed(params, jnp.asarray(ids))
        for i in range(model.num_layers):
            hidden = model.model.layer(i, params, hidden)
    # Compiled against eager float32 over five layers: summation order differs (XLA's CPU dot fusions), so the
    # absolute tolerance follows the activations' scale; a wrong window or program is off by O(1).
    scale = float(np.abs(np.asarray(hidden)).max())
    np.testing.assert_allclose(np.asarray(shared[-1].hidden), np.asarray(hidden), rtol=1e-5, atol=1e-5 * scale)


def test_a_family_without_signatures_compiles_each_layer(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "m", layers=3)
    config = json.loads((folder / "config.json").read_text())

    class NoSignature(CountingModel):
        def __getattr__(self, name):
            if name == "layer_signature":
                raise AttributeError(name)
            return getattr(self.model, name)

    model = NoSignature(build(config))
    list(iterate_layers(model, open_params(folder), random_windows(256, 2, 8, seed=0)))
    assert model.traces == 3


# Both scripts: the checkpoint folder and sample count from argv, the model, its windows and every linear.
_SCRIPT_SETUP = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from qconvert.calibration.data import random_windows
    from qconvert.calibration.observer import iter_layer_stats, open_params
    from qconvert.calibration.statistics import InputAbsMax, InputHessian, KeptRows
    from qconvert.models import build

    folder, samples = sys.argv[1], int(sys.argv[2])
    config = json.load(open(folder + "/config.json"))
    model, params = build(config), open_params(folder)
    ids = random_windows(int(config["vocab_size"]), samples, 16, seed=5)
    keep = {m for i in range(model.num_layers) for m in model.layer_linears(i)}
    runs = {}
""")

_DEVICES_SCRIPT = _SCRIPT_SETUP + textwrap.dedent("""
    for label, devices in (("four", jax.devices()), ("one", jax.devices()[:1])):
        runs[label] = list(iter_layer_stats(model, params, ids, batch_size=2, keep_inputs=keep,
                                            sample_rows=40, devices=devices, hessians=keep))
    report = {"devices": len(jax.devices()), "modules": 0, "absmax_equal": True, "rows_equal": True,
              "rows": 0, "hessians": 0, "hessians_equal": True}
    for a, b in zip(runs["four"], runs["one"]):
        assert sorted(a.of(InputAbsMax)) == sorted(b.of(InputAbsMax))
        for m in a.of(InputAbsMax):
            report["modules"] += 1
            report["absmax_equal"] &= bool(np.array_equal(a.of(InputAbsMax)[m], b.of(InputAbsMax)[m]))
            assert (m in a.of(KeptRows)) == (m in b.of(KeptRows)) == (m in keep)
            if m in keep:
                report["rows_equal"] &= bool(np.array_equal(a.of(KeptRows)[m], b.of(KeptRows)[m]))
                report["rows"] += len(b.of(KeptRows)[m])
        assert sorted(a.of(InputHessian)) == sorted(b.of(InputHessian)) and {m: v['tokens'] for m, v in a.of(InputHessian).items()} == {m: v['tokens'] for m, v in b.of(InputHessian).items()}
        for m in b.of(InputHessian):
            report["hessians"] += 1
            report["hessians_equal"] &= bool(np.array_equal(np.asarray(a.of(InputHessian)[m]["hessian"]), np.asarray(b.of(InputHessian)[m]["hessian"])))
    print(json.dumps(report))
""")


@pytest.mark.parametrize("family", ["llama", "mixtral"])
# 8: 4 batches of 2, one per device; 19: two groups of four batches (the sums carried from one to the next), a
# batch and a half left over
@pytest.mark.parametrize("samples", [8, 19])
def test_statistics_on_four_devices_equal_one_device(tmp_path, family, samples):
    if family == "llama":
        folder = make_llama_checkpoint(tmp_path / "m", layers=2, outlier_channels=(3,))
    else:
        folder = make_mixtral_checkpoint(tmp_path / "m")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _DEVICES_SCRIPT, str(folder), str(samples)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    assert report["modules"] > 0 and report["rows"] > 0 and report["hessians"] > 0
    # Bit-equal: the per-channel maxima, the sampled input rows and the Hessians of every linear.
    assert report["absmax_equal"] and report["rows_equal"] and report["hessians_equal"], report


def test_iter_layer_stats_one_device_matches_separate_programs(tmp_path):
    """Shared programs change nothing in the statistics (same values as one program per layer)."""
    folder, config = _windowed_llama(tmp_path / "m")
    params = open_params(folder)
    ids = random_windows(256, 5, 8, seed=2)
    model = build(config)
    keep = {m for i in range(model.num_layers) for m in model.layer_linears(i)}
    got = list(iter_layer_stats(model, params, ids, batch_size=2, keep_inputs=keep, sample_rows=16))
    assert all(set(layer.of(KeptRows)) == set(layer.of(InputAbsMax)) for layer in got[:model.num_layers])
    separate = list(iterate_layers(model, params, ids, batch_size=2, share_programs=False,
                                   observe=lambda name, x, valid: jnp.max(jnp.abs(x).reshape(-1, x.shape[-1]), 0)))
    for layer, ref in zip(got, separate):
        for name, values in ref.observed.items():
            np.testing.assert_array_equal(layer.of(InputAbsMax)[name], np.max(np.stack(values), axis=0))


_SPLIT_EXPERTS_SCRIPT = _SCRIPT_SETUP + textwrap.dedent("""
    from qconvert.calibration.expert_parallel import Mesh, expert_stacks, place_experts

    for label, devices, split in (("four", jax.devices(), True), ("one", jax.devices()[:1], False)):
        runs[label] = list(iter_layer_stats(model, params, ids, batch_size=2, keep_inputs=keep, sample_rows=40,
                                            devices=devices, hessians=keep, shard_experts=split))
    report = {"devices": len(jax.devices()), "equal": [], "differ": [], "worst": 0.0, "tokens_equal": True}
    for a, b in zip(runs["four"], runs["one"]):
        assert sorted(a.of(InputAbsMax)) == sorted(b.of(InputAbsMax)) and sorted(a.of(InputHessian)) == sorted(b.of(InputHessian))
        report["tokens_equal"] &= {m: v["tokens"] for m, v in a.of(InputHessian).items()} == {m: v["tokens"] for m, v in b.of(InputHessian).items()}
        for m in b.of(InputHessian):
            x, y = np.asarray(a.of(InputHessian)[m]["hessian"]), np.asarray(b.of(InputHessian)[m]["hessian"])
            (report["equal"] if np.array_equal(x, y) else report["differ"]).append(m)
        for x, y in [(a.of(InputHessian)[m]["hessian"], b.of(InputHessian)[m]["hessian"]) for m in b.of(InputHessian)] + \\
                    [(a.of(InputAbsMax)[m], b.of(InputAbsMax)[m]) for m in b.of(InputAbsMax)] + \\
                    [(a.of(KeptRows)[m], b.of(KeptRows)[m]) for m in b.of(KeptRows)]:
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            report["worst"] = max(report["worst"], float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    # Where layer 0's experts live: each device its own whole expert of every projection.
    names = model.layer_tensor_names(0)
    tensors = {n: np.asarray(params[n]) for n in names}
    placed = place_experts(tensors, Mesh(np.asarray(jax.devices()), ("data",)))
    report["stacks"] = {}
    for key, experts in expert_stacks(names).items():
        shards = sorted(placed.stacks[key].addressable_shards, key=lambda s: s.device.id)
        report["stacks"][key] = [[list(s.data.shape), s.device.id,
                                  bool(np.array_equal(np.asarray(s.data)[0], tensors[experts[k]]))]
                                 for k, s in enumerate(shards)]
    report["dense_outside_stacks"] = sorted(set(placed.dense) & {n for e in expert_stacks(names).values() for n in e})
    # --shard-experts auto on devices that state their memory: between what the layer needs split and whole it
    # runs split (the very statistics `always` gives); below what it needs split it is refused.
    from qconvert.calibration import observer
    from qconvert.calibration.memory import checkpoint_shapes, estimate
    shapes = checkpoint_shapes(model, params)
    need = {split: estimate(shapes, samples, 16, 1, hessians=True, devices=4, experts_split=split).device_bytes
            for split in (False, True)}
    report["need"] = need[True] < need[False]

    def stats(budget, split):
        observer.device_budget = lambda device: budget
        try:
            return list(iter_layer_stats(model, params, ids, batch_size=2, keep_inputs=keep, sample_rows=40,
                                         hessians=keep, shard_experts=split))
        except Exception as err:
            return str(err)

    auto, always, never = (stats(need[False] - 1, split) for split in (None, True, False))
    report["auto_is_split"] = all(np.array_equal(np.asarray(a.of(InputHessian)[m]["hessian"]), np.asarray(b.of(InputHessian)[m]["hessian"]))
                                  for a, b in zip(auto, always) for m in b.of(InputHessian))
    report["auto_differs_from_whole"] = any(
        not np.array_equal(np.asarray(a.of(InputHessian)[m]["hessian"]), np.asarray(b.of(InputHessian)[m]["hessian"]))
        for a, b in zip(auto, runs["one"]) for m in b.of(InputHessian))
    report["never"] = never if isinstance(never, str) else "ran"
    report["too_small"] = stats(need[True] - 1, None)
    report["too_small"] = report["too_small"] if isinstance(report["too_small"], str) else "ran"
    print(json.dumps(report))
""")


def test_experts_split_over_four_devices_hold_one_each_and_agree_with_one_device(tmp_path):
    """shard_experts: a Mixtral layer's 4 experts, one a device. What comes before any expert's output (layer 0's
    attention, router, w1 and w3 inputs) is bit for bit one device's, each expert's Hessian summed by its owner
    alone as one device sums it; the rest within float32 rounding (a ragged_dot over fewer experts)."""
    folder = make_mixtral_checkpoint(tmp_path / "m")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    # 11 samples at 2 a batch: a group of four batches, then a batch and a half that every device runs (the sums
    # carried from the group into them)
    proc = subprocess.run([sys.executable, "-c", _SPLIT_EXPERTS_SCRIPT, str(folder), "11"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4 and report["tokens_equal"]
    layer0 = [m for m in report["equal"] + report["differ"] if ".layers.0." in m]
    before_experts_out = [m for m in layer0 if not m.endswith(".w2")]
    assert len(before_experts_out) == 4 + 1 + 4 * 2 and sorted(before_experts_out) == sorted(
        m for m in report["equal"] if ".layers.0." in m)
    assert report["worst"] < 1e-5, report
    assert set(report["stacks"]) == {"model.layers.0.block_sparse_moe.experts.*.w1.weight",
                                     "model.layers.0.block_sparse_moe.experts.*.w2.weight",
                                     "model.layers.0.block_sparse_moe.experts.*.w3.weight"}
    for shards in report["stacks"].values():  # device d: [1, out, in], expert d
        assert [(shape[0], device, same) for shape, device, same in shards] == [(1, d, True) for d in range(4)]
    assert report["dense_outside_stacks"] == []
    # auto: split where the layer does not fit whole, refused (one line) where it does not fit split either
    assert report["need"] and report["auto_is_split"] and report["auto_differs_from_whole"], report
    assert "GiB on each device even one window at a time" in report["never"], report["never"]
    assert "GiB on each device with the experts split over 4 devices even one window" in report["too_small"]
