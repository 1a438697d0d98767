"""The per-layer loop runs any Step: it knows no method, hands each layer's complete statistics to every step
in order, and gathers only what the steps ask for."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
from checkpoints import make_llama_checkpoint

from qconvert.calibration.data import random_windows
from qconvert.calibration.observer import open_params
from qconvert.calibration.statistics import InputHessian, KeptRows
from qconvert.methods.loop import Calibration, Results, run_layers
from qconvert.models import build
from qconvert.progress import SILENT

ROOT = Path(__file__).resolve().parents[2]
# Every module of methods/ but the loop itself and the fold every step shares.
METHOD_MODULES = tuple(p.stem for p in (ROOT / "qconvert" / "methods").glob("*.py")
                       if p.stem not in ("__init__", "loop", "fold"))


class Recorder:
    """A step that asks for one linear's rows and another's Hessian, and records what each call saw."""

    rewrites = False

    def __init__(self, name, rows=(), hessians=(), results_seen=None):
        self.name, self.rows, self.wanted = name, set(rows), frozenset(hessians)
        self.calls, self.results_seen = [], results_seen

    def statistics(self):
        return [KeptRows(frozenset(self.rows)), InputHessian(self.wanted)]

    def start(self, progress):
        self.calls.append(("start",))

    def layer(self, stats, results):
        self.calls.append(("layer", stats.index, sorted(stats.of(KeptRows)), sorted(stats.of(InputHessian)),
                           sorted(results.act_absmax)))
        if self.results_seen is not None:
            self.results_seen.append(dict(results.clips))
        results.clips[f"{self.name}.{stats.index}"] = np.ones(1, np.float32)

    def finish(self, results):
        self.calls.append(("finish",))

    def replacement(self, index):
        return None


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = make_llama_checkpoint(tmp_path_factory.mktemp("loop") / "m", layers=2)
    config = json.loads((folder / "config.json").read_text())
    return build(config), open_params(folder), random_windows(int(config["vocab_size"]), 3, 16, 0)


def test_the_loop_imports_no_method():
    tree = ast.parse((ROOT / "qconvert" / "methods" / "loop.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not [m for m in imported if m.rsplit(".", 1)[-1] in METHOD_MODULES]


def test_each_step_sees_every_layer_in_order_with_only_what_it_asked_for(llama):
    model, params, ids = llama
    q0, down1 = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    first = Recorder("first", rows=[q0])
    second_saw: list = []
    second = Recorder("second", hessians=[down1], results_seen=second_saw)
    run_layers(model, Calibration(ids, batch_size=2), [first, second], Results(params), SILENT)
    layers = [c for c in first.calls if c[0] == "layer"]
    assert [c[1] for c in layers] == [0, 1, 2]  # two layers, then the head's inputs
    second_layers = [c for c in second.calls if c[0] == "layer"]
    # The statistics gathered are what the steps asked for together, no more: rows of q0; down_proj's Hessian
    # (every layer's: layers that share one program observe alike, calibration/observer.py).
    for calls in (layers, second_layers):
        assert [c[2] for c in calls] == [[q0], [], []]
        assert [c[3] for c in calls] == [[down1.replace(".1.", ".0.")], [down1], []]
    # A layer's statistics are complete when its steps run: every linear of layers 0..i has its maxima.
    for index, call in enumerate(layers[:2]):
        assert {m for m in call[4] if ".layers." in m} == {m for m in model.linear_names(params.checkpoint.tensor_names)
                                                            if int(m.split(".")[2]) <= index}
    # Steps run in order: the second sees what the first added for the same layer.
    assert [sorted(seen) for seen in second_saw] == [["first.0"], ["first.0", "first.1", "second.0"],
                                                    ["first.0", "first.1", "first.2", "second.0", "second.1"]]
    assert first.calls[0] == ("start",) and ("finish",) not in first.calls  # finish is the recipe's to call


class ChannelScale(Recorder):
    """A whole-model transform (as a rotation would be one): up_proj's row j times 2 and down_proj's column j
    halved in every layer, which leaves the model's function as it was but doubles down_proj's input channel j."""

    channel = 5

    def model_transform(self, params):
        j = self.channel

        def transform(name, array):
            if name.endswith("mlp.up_proj.weight"):
                array = array.copy()
                array[j] = array[j] * 2
            elif name.endswith("mlp.down_proj.weight"):
                array = array.copy()
                array[:, j] = array[:, j] / 2
            return array

        return transform


def test_a_whole_model_transform_runs_before_calibration_and_reaches_every_reader(llama):
    from qconvert.methods.loop import transform_model

    model, params, ids = llama
    plain = Results(params)
    run_layers(model, Calibration(ids, batch_size=2), [Recorder("plain")], plain, SILENT)
    step = ChannelScale("scaled")
    results = Results(params)
    transform = transform_model([step], results)
    run_layers(model, Calibration(ids, batch_size=2), [step], results, SILENT)
    j, down = ChannelScale.channel, "model.layers.0.mlp.down_proj"
    # Calibration saw the transformed model: the channel doubled (SwiGLU's up is linear in up_proj's row) ...
    np.testing.assert_allclose(results.act_absmax[down][j], 2 * plain.act_absmax[down][j], rtol=1e-6)
    others = np.arange(len(plain.act_absmax[down])) != j
    np.testing.assert_allclose(results.act_absmax[down][others], plain.act_absmax[down][others], rtol=1e-6)
    # ... whose function is unchanged: the next layer's inputs are the same up to float32 rounding.
    q1 = "model.layers.1.self_attn.q_proj"
    np.testing.assert_allclose(results.act_absmax[q1], plain.act_absmax[q1], rtol=1e-5)
    # The steps and the writer read the same transformed tensors.
    up = np.asarray(params["model.layers.1.mlp.up_proj.weight"])
    assert np.array_equal(results.params["model.layers.1.mlp.up_proj.weight"][j], up[j] * 2)
    assert np.array_equal(transform("model.layers.1.mlp.up_proj.weight", up)[j], up[j] * 2)


def test_a_whole_model_transform_reaches_the_written_folder(tmp_path, monkeypatch):
    """A conversion whose recipe gains the transforming step writes the transformed model: up_proj's row j
    doubled (int8 per output row: its scale doubles, its codes stay), down_proj's column j halved."""
    import qconvert.convert as convert_module
    from cli_helpers import quantize_quietly
    from safetensors.numpy import load_file

    from checkpoints import make_tokenizer

    source = make_llama_checkpoint(tmp_path / "src", layers=1)
    make_tokenizer(source)  # the built-in calibration text, tokenized
    choose = convert_module.choose_steps

    def with_transform(*args, **kwargs):
        return [ChannelScale("scaled"), *choose(*args, **kwargs)]

    monkeypatch.setattr(convert_module, "choose_steps", with_transform)
    out = quantize_quietly(source, tmp_path / "out", "--scheme", "int8")
    monkeypatch.undo()
    plain = quantize_quietly(source, tmp_path / "plain", "--scheme", "int8")
    got, want = load_file(out / "model.safetensors"), load_file(plain / "model.safetensors")
    j, up, down = ChannelScale.channel, "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    assert np.array_equal(got[f"{up}.weight_packed"], want[f"{up}.weight_packed"])
    scale, plain_scale = got[f"{up}.weight_scale"].astype(np.float32), want[f"{up}.weight_scale"].astype(np.float32)
    np.testing.assert_allclose(scale[j], 2 * plain_scale[j], rtol=1e-2)
    rows = np.arange(len(scale)) != j
    assert np.array_equal(scale[rows], plain_scale[rows])
    assert not np.array_equal(got[f"{down}.weight_packed"], want[f"{down}.weight_packed"])
