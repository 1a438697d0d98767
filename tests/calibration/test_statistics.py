"""Calibration statistics are objects a step asks for: the engine computes exactly those, at any site, and knows
none by name. Attention's keys and values are judged by transformers' own KV cache."""

import ast
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from hf_checkpoints import make_hf_checkpoint

from qconvert.calibration.observer import iter_layer_stats, open_params
from qconvert.calibration.statistics import (OUTPUT, AttentionAbsMax, InputAbsMax, InputHessian, KeptRows, Statistic,
                                             merge_requests)
from qconvert.models import build

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ("layers.py", "data_parallel.py", "expert_parallel.py", "device_sums.py", "layer_hooks.py")


@dataclasses.dataclass(frozen=True)
class OutputAbsMax(Statistic):
    """A statistic the engine has never heard of: max|y| per output channel of a linear (its output site)."""

    site = OUTPUT
    key = "test_output_absmax"

    def observe(self, name, y, valid, run):
        magnitude = jnp.where(valid.reshape(-1)[:, None], jnp.abs(y.reshape(-1, y.shape[-1])), 0.0)
        return {"max": jnp.max(magnitude, axis=0)}, {}

    def values(self, observed):
        return {name: np.max(np.stack([np.asarray(o["max"]) for o in entries.listed]), axis=0)
                for name, entries in observed.items() if entries.listed and self.asked(name)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 (q/k norms before RoPE, head_dim apart from hidden / heads) and the windows it runs on."""
    folder = make_hf_checkpoint(tmp_path_factory.mktemp("stats") / "qwen3", "qwen3", layers=2)
    config = json.loads((folder / "config.json").read_text())
    ids = np.random.default_rng(3).integers(0, config["vocab_size"], (3, 12))
    return folder, build(config), open_params(folder), ids


def _transformers_run(folder, ids):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = {}
    hooks = [module.register_forward_hook(lambda m, i, o, name=name: outputs.__setitem__(name, o.detach().numpy()))
             for name, module in model.named_modules() if name.endswith("mlp.down_proj")]
    with torch.no_grad():
        cache = model(torch.as_tensor(ids), use_cache=True).past_key_values
    for hook in hooks:
        hook.remove()
    layers = [(cache.layers[i].keys.numpy(), cache.layers[i].values.numpy()) for i in range(len(cache.layers))]
    return layers, outputs


def test_attention_keys_and_values_are_what_transformers_caches(qwen3):
    folder, model, params, ids = qwen3
    blocks = [f"model.layers.{i}.self_attn" for i in range(model.num_layers)]
    stats = list(iter_layer_stats(model, params, ids, batch_size=2, statistics=[AttentionAbsMax(frozenset(blocks))]))
    cached, _ = _transformers_run(folder, ids)
    for i, block in enumerate(blocks):
        got = stats[i].of(AttentionAbsMax)[block]
        keys, values = cached[i]  # [B, kv_heads, T, head_dim], keys after RoPE
        np.testing.assert_allclose(got["keys"], np.abs(keys).max(), rtol=2e-5)
        np.testing.assert_allclose(got["values"], np.abs(values).max(), rtol=2e-5)


def test_a_new_statistic_at_the_output_site_needs_no_engine_change(qwen3):
    folder, model, params, ids = qwen3
    downs = frozenset(f"model.layers.{i}.mlp.down_proj" for i in range(model.num_layers))
    stats = list(iter_layer_stats(model, params, ids, batch_size=2, statistics=[OutputAbsMax(downs)]))
    _, outputs = _transformers_run(folder, ids)
    for i in range(model.num_layers):
        name = f"model.layers.{i}.mlp.down_proj"
        np.testing.assert_allclose(stats[i].of(OutputAbsMax)[name], np.abs(outputs[name]).max(axis=(0, 1)),
                                   rtol=1e-4, atol=1e-6)
        assert set(stats[i].of(OutputAbsMax)) == {name}  # only what was asked for
    assert all(not stats[i].of(KeptRows) and not stats[i].of(InputHessian) for i in range(model.num_layers))


def test_requests_of_one_kind_merge_into_one_statistic():
    a, b = KeptRows(frozenset({"x.q_proj"})), KeptRows(frozenset({"x.down_proj"}))
    merged = merge_requests([InputAbsMax(), a, b])
    rows = [s for s in merged if isinstance(s, KeptRows)]
    assert [sorted(s.modules) for s in rows] == [["x.down_proj", "x.q_proj"]]
    assert merge_requests([InputAbsMax(frozenset({"a"})), InputAbsMax()])[0].modules is None
    with pytest.raises(ValueError, match="one key"):  # two row samples of other sizes cannot share one key
        merge_requests([a, KeptRows(frozenset({"x.o_proj"}), sample_rows=16)])


def test_the_engine_names_no_statistic():
    keys = {cls.key for cls in (InputAbsMax, KeptRows, InputHessian, AttentionAbsMax)} | {"abs_sum", "tokens"}
    for file in ENGINE:
        source = (ROOT / "qconvert" / "calibration" / file).read_text()
        tree = ast.parse(source)
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "qconvert.calibration.statistics" not in imported, file
        strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert not strings & keys, (file, strings & keys)
