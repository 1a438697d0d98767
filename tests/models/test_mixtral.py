"""The Mixtral JAX forward matches transformers (float32); experts run through the grouped hook."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from checkpoints import make_mixtral_checkpoint
from qconvert.models import MixtralModel, build
from qconvert.calibration.layers import forward_layerwise, iterate_layers
from qconvert.models.hooks import dense_grouped_linear
from qconvert.models.registry import family_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Measured max abs diff ~2.4e-7 on logits of scale ~1; top-k routing decisions are
# identical on both sides (random floats, no ties).
RTOL = 1e-5


def _setup(tmp_path, **kwargs):
    folder = make_mixtral_checkpoint(tmp_path, **kwargs)
    config = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(3)
    ids = rng.integers(3, config["vocab_size"], size=(2, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, -4:] = 0
    return folder, config, load_file(str(folder / "model.safetensors")), ids, mask


def _reference_logits(folder, ids, mask) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long),
                     attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()


def _assert_close(got, expected, mask):
    valid = mask.astype(bool)
    scale = np.abs(expected[valid]).max()
    err = np.abs(np.asarray(got)[valid] - expected[valid]).max()
    assert err <= RTOL * scale, f"max abs diff {err} vs logits scale {scale}"


def test_mixtral_logits_match_transformers_with_sliding_window(tmp_path):
    folder, config, params, ids, mask = _setup(tmp_path, sliding_window=4)
    expected = _reference_logits(folder, ids, mask)
    model = build(config)
    assert isinstance(model, MixtralModel)
    # Whole forward under one jit (op-by-op dispatch of the routing is slow on CPU).
    _assert_close(jax.jit(model.forward)(params, ids, mask), expected, mask)
    # The same through the layer-by-layer runner (jit-compiled layers).
    _assert_close(forward_layerwise(model, params, ids, mask, batch_size=1), expected, mask)


def test_experts_through_the_grouped_matmul_kernel_match_transformers(tmp_path):
    from qconvert.kernels import grouped_matmul

    folder, config, params, ids, mask = _setup(tmp_path, layers=1)
    expected = _reference_logits(folder, ids, mask)

    def kernel_grouped_linear(names, x, weights, group_sizes):
        rhs = jnp.stack([jnp.asarray(w, jnp.float32) for w in weights])  # [E, out, in]
        return grouped_matmul(x, rhs, group_sizes, transpose_rhs=True, backend="cpu")

    model = build(config)
    _assert_close(jax.jit(lambda p, i, m: model.forward(p, i, m, grouped_linear=kernel_grouped_linear))(
        params, ids, mask), expected, mask)


def test_experts_go_through_the_grouped_hook_with_rows_sorted_by_expert(tmp_path):
    _, config, params, ids, mask = _setup(tmp_path, layers=1)
    model = build(config)
    calls = []

    def spy(names, x, weights, group_sizes):
        calls.append((list(names), int(np.sum(group_sizes)), x.shape[0]))
        return dense_grouped_linear(names, x, weights, group_sizes)

    model.forward(params, ids, mask, grouped_linear=spy)
    assert [c[0] for c in calls] == [model.expert_linears(0, p) for p in ("w1", "w3", "w2")]
    # Every real token goes to top_k experts; padding tokens go to none.
    real_pairs = int(mask.sum()) * config["num_experts_per_tok"]
    assert all(c[1] == real_pairs and c[2] == ids.size * config["num_experts_per_tok"] for c in calls)


def test_runner_observes_each_expert_input_only_on_its_routed_tokens(tmp_path):
    _, config, params, ids, mask = _setup(tmp_path, layers=1)
    model = build(config)
    gate = "model.layers.0.block_sparse_moe.gate"

    def observe(name, x, valid):
        return (jnp.sum(valid), x) if name == gate else jnp.sum(valid)

    (result,) = list(iterate_layers(model, params, ids, mask, observe=observe))
    k = config["num_experts_per_tok"]
    per_expert = [int(result.observed[n][0]) for n in model.expert_linears(0, "w1")]
    assert min(per_expert) > 0  # the spread-out router uses every expert
    # Independent routing in numpy from the router's input: each real token's top-k logits.
    gate_tokens, gate_x = result.observed[gate][0]
    assert int(gate_tokens) == int(mask.sum())
    logits = np.asarray(gate_x).reshape(-1, config["hidden_size"]) @ params[f"{gate}.weight"].T
    chosen = np.argsort(-logits, axis=-1)[:, :k][mask.reshape(-1).astype(bool)]
    assert per_expert == np.bincount(chosen.reshape(-1), minlength=len(per_expert)).tolist()
    assert [int(result.observed[n][0]) for n in model.expert_linears(0, "w2")] == per_expert


def test_router_stays_float_and_smoothing_group_keeps_the_model_unchanged(tmp_path):
    _, config, params, ids, mask = _setup(tmp_path, layers=1)
    linears = family_for(config).linear_names(params)
    assert "model.layers.0.block_sparse_moe.experts.3.w2" in linears
    assert not any(name.endswith(".gate") for name in linears)

    # Fold arbitrary positive scales into every smoothing group as SmoothQuant does:
    # the norm divides by s, every listed linear's columns multiply by s.
    model = build(config)
    forward = jax.jit(model.forward)
    before = np.asarray(forward(params, ids, mask))
    rng = np.random.default_rng(0)
    smoothed = dict(params)
    for group in model.smoothing_groups():
        s = rng.uniform(0.25, 4.0, size=config["hidden_size"]).astype(np.float32)
        smoothed[f"{group.source}.weight"] = smoothed[f"{group.source}.weight"] / s
        for linear in group.linears:
            smoothed[f"{linear}.weight"] = smoothed[f"{linear}.weight"] * s[None, :]
    after = np.asarray(forward(smoothed, ids, mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(after[valid], before[valid], atol=1e-4 * np.abs(before).max())
