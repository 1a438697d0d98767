"""Qwen3, Phi-3, Qwen2-MoE and Qwen3-MoE: the JAX forward matches transformers (float32), the
quantized linears and smoothing groups are the family's, and expected_shapes fits the checkpoint."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_checkpoints import TINY, load_config, make_hf_checkpoint, reference_logits, token_batch
from qconvert.formats.errors import InvalidCheckpointError
from qconvert.calibration.layers import forward_layerwise
from qconvert.models import Phi3Model, Qwen2MoeModel, Qwen3Model, Qwen3MoeModel, build
from qconvert.models.registry import family_for
from qconvert.methods.fold import channel_map

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = {"qwen3": Qwen3Model, "phi3": Phi3Model, "qwen2_moe": Qwen2MoeModel, "qwen3_moe": Qwen3MoeModel}
# float32 on both sides; measured max abs diff 1.3e-6 to 3.4e-6 on logits of scale ~4
# (summation order only). Top-k routing has no near-ties with the spread-out routers.
RTOL = 1e-5


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "src", request.param)
    return request.param, folder, load_config(folder), load_file(str(folder / "model.safetensors"))


def assert_logits_close(got, expected, mask, rtol=RTOL):
    valid = np.asarray(mask).astype(bool)
    scale = np.abs(expected[valid]).max()
    err = np.abs(np.asarray(got)[valid] - expected[valid]).max()
    assert err <= rtol * scale, f"max abs diff {err} vs logits scale {scale}"


def test_logits_match_transformers_whole_and_layer_by_layer(family):
    name, folder, config, params = family
    ids, mask = token_batch(config["vocab_size"])
    expected = reference_logits(folder, ids, mask)
    model = build(config)
    assert type(model) is FAMILIES[name]
    assert_logits_close(jax.jit(model.forward)(params, ids, mask), expected, mask)
    assert_logits_close(forward_layerwise(model, params, ids, mask, batch_size=1), expected, mask)


def test_expected_shapes_name_every_tensor_of_the_transformers_checkpoint(family):
    _, _, config, params = family
    expected = build(config).expected_shapes()
    assert expected == {name: tuple(array.shape) for name, array in params.items()}


def _expected_linears(name: str, layer: int) -> set[str]:
    p = f"model.layers.{layer}"
    if name == "phi3":
        return {f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"}
    attention = {f"{p}.self_attn.{x}_proj" for x in "qkvo"}
    if name == "qwen3":
        return attention | {f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")}
    experts = {f"{p}.mlp.experts.{e}.{x}_proj" for e in range(4) for x in ("gate", "up", "down")}
    if name == "qwen2_moe":
        experts |= {f"{p}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")}
    return attention | experts


def test_quantized_linears_are_the_blocks_projections_routers_stay_float(family):
    name, _, config, params = family
    linears = family_for(config).linear_names(params)
    assert set(linears) == _expected_linears(name, 0) | _expected_linears(name, 1)


def test_smoothing_groups_fold_without_changing_the_float_model(family):
    """Fold arbitrary positive scales into every group as SmoothQuant does (the source's output
    channels divide by s, the linears' input columns multiply by s): the logits stay the same."""
    name, _, config, params = family
    model = build(config)
    groups = model.smoothing_groups() + model.linear_smoothing_groups()
    sources = {g.source for g in groups}
    assert {f"model.layers.{i}.{n}" for i in range(2)
            for n in ("input_layernorm", "post_attention_layernorm")} <= sources
    assert ("model.layers.1.self_attn.qkv_proj" if name == "phi3" else "model.layers.1.self_attn.v_proj") in sources
    rng = np.random.default_rng(0)
    smoothed = dict(params)
    covered = set()
    for group in groups:
        in_features = params[f"{group.linears[0]}.weight"].shape[1]
        index = channel_map(group, in_features)
        s = rng.uniform(0.25, 4.0, size=int(index.max()) + 1).astype(np.float32)
        rows = slice(group.source_offset, group.source_offset + len(s))  # a fused source: some rows only
        for suffix in (".weight", ".bias"):
            source = f"{group.source}{suffix}"
            if source in smoothed:
                w = smoothed[source].copy()
                w[rows] = w[rows] / (s if w.ndim == 1 else s[:, None])
                smoothed[source] = w
        for linear in group.linears:
            smoothed[f"{linear}.weight"] = smoothed[f"{linear}.weight"] * s[index][None, :]
            covered.add(linear)
    # Every quantized linear's input is smoothed; the routers (and shared-expert gates) that
    # read the same norm's output absorb s too but stay float.
    linears = set(model.linear_names(params))
    assert linears <= covered
    assert {m.rsplit(".", 1)[1] for m in covered - linears} <= {"gate", "shared_expert_gate"}
    ids, mask = token_batch(config["vocab_size"])
    forward = jax.jit(build(config).forward)
    before = np.asarray(forward(params, ids, mask))
    assert_logits_close(forward(smoothed, ids, mask), before, mask, rtol=1e-4)


def test_a_config_value_that_does_not_fit_names_its_key(family):
    name, _, config, _ = family
    key = {"qwen3": "head_dim", "phi3": "partial_rotary_factor", "qwen2_moe": "moe_intermediate_size",
           "qwen3_moe": "num_experts_per_tok"}[name]
    bad = {**config, key: "16"}
    if name == "phi3":  # transformers 5 keeps it in rope_parameters, which wins over the top level
        bad = {**config, "rope_parameters": {**config["rope_parameters"], key: "16"}}
    with pytest.raises(InvalidCheckpointError, match=key):
        build(bad)
    if "moe" in name:  # more experts per token than there are
        with pytest.raises(InvalidCheckpointError, match="num_experts_per_tok"):
            build({**config, "num_experts_per_tok": 9})


def _assert_matches_transformers(folder, seq: int = 10):
    config = load_config(folder)
    params = load_file(str(folder / "model.safetensors"))
    ids, mask = token_batch(config["vocab_size"], seq=seq)
    model = build(config)
    assert_logits_close(jax.jit(model.forward)(params, ids, mask), reference_logits(folder, ids, mask), mask)
    assert model.expected_shapes() == {name: tuple(array.shape) for name, array in params.items()}
    return model


def test_phi3_partial_rotary_and_sliding_window_match_transformers(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "phi3", layers=1, partial_rotary_factor=0.5, sliding_window=4)
    model = _assert_matches_transformers(folder)
    assert model.rotary_dim == 8 and model.args.sliding_windows == (4,)


def test_qwen3_sliding_layers_past_max_window_layers_match_transformers(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = _assert_matches_transformers(folder)
    assert model.args.sliding_windows == (None, 4)


def test_qwen2_moe_dense_mlp_only_layer_and_renormalized_top_k_match_transformers(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "qwen2_moe", mlp_only_layers=[0], norm_topk_prob=True)
    model = _assert_matches_transformers(folder)
    assert model.moe.sparse_layers == (False, True) and model.moe.norm_topk_prob
    assert "model.layers.0.mlp.gate_proj" in model.layer_linears(0)
    groups = {g.source: g.linears for g in build(load_config(folder)).smoothing_groups()}
    assert groups["model.layers.0.post_attention_layernorm"] == ("model.layers.0.mlp.gate_proj",
                                                                 "model.layers.0.mlp.up_proj")
    assert "model.layers.1.mlp.gate" in groups["model.layers.1.post_attention_layernorm"]



# One layer at the attention and MLP geometry of released models: Qwen3-0.6B (head_dim 128
# apart from hidden / heads), Phi-3-mini's head_dim 96 at a smaller width. The MoE families
# share these attention paths; their experts run through the same grouped hook as Mixtral's.
RELEASED_GEOMETRY = {
    "qwen3": dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072),
    "phi3": dict(hidden=768, heads=8, kv_heads=8, intermediate=2048),
}


@pytest.mark.parametrize("name", sorted(RELEASED_GEOMETRY))
def test_released_geometry_matches_transformers(name, tmp_path):
    folder = make_hf_checkpoint(tmp_path, name, layers=1, vocab=64, **RELEASED_GEOMETRY[name])
    _assert_matches_transformers(folder, seq=8)


@pytest.mark.parametrize("name, architecture", [("qwen2_moe", "Qwen2MoeForCausalLM"),
                                                ("qwen3_moe", "Qwen3MoeForCausalLM")])
def test_moe_keys_a_config_leaves_out_take_the_transformers_defaults(name, architecture):
    defaults = getattr(transformers, TINY[name][0])(num_hidden_layers=4)
    config = {k: v for k, v in defaults.to_dict().items()
              if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    moe = build({**config, "architectures": [architecture]}).moe
    assert moe.norm_topk_prob == defaults.norm_topk_prob
    assert moe.sparse_layers == tuple(i not in defaults.mlp_only_layers and (i + 1) % defaults.decoder_sparse_step == 0
                                      for i in range(4))
