"""DeepSeek-V3 (tiny, built by transformers): the JAX forward matches transformers' logits (MLA with and without
q_lora_rank, yarn RoPE on interleaved pairs, dense then expert layers, the group-limited sigmoid router with its
correction bias), the quantized linears and smoothing groups are the family's, and yarn matches transformers on
another family too."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_checkpoints import load_config, make_hf_checkpoint, reference_logits, token_batch
from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError
from qconvert.methods.fold import channel_map
from qconvert.methods.smooth import group_scales
from qconvert.calibration.layers import forward_layerwise
from qconvert.models import DeepseekV3Model, build
from qconvert.models.registry import family_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# float32 on both sides; measured max abs diff 3.8e-6 (q_lora_rank) and 3.0e-6 (q_proj) on logits of scale ~4.
RTOL = 1e-5
# The second variant: queries from q_proj, plain RoPE on the two halves, no yarn.
VARIANTS = {"q_lora_yarn_interleaved": {},
            "q_proj_plain_rope": dict(q_lora_rank=None, rope_scaling=None, rope_interleave=False)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "src", "deepseek_v3", kv_heads=4,
                                **VARIANTS[request.param])
    return folder, load_config(folder), load_file(str(folder / "model.safetensors"))


def assert_logits_close(got, expected, mask, rtol=RTOL):
    valid = np.asarray(mask).astype(bool)
    scale = np.abs(expected[valid]).max()
    err = np.abs(np.asarray(got)[valid] - expected[valid]).max()
    assert err <= rtol * scale, f"max abs diff {err} vs logits scale {scale}"


def test_logits_match_transformers_whole_and_layer_by_layer(tiny):
    folder, config, params = tiny
    ids, mask = token_batch(config["vocab_size"])
    expected = reference_logits(folder, ids, mask)
    model = build(config)
    assert type(model) is DeepseekV3Model and model.moe.sparse_layers == (False, True)
    assert_logits_close(jax.jit(model.forward)(params, ids, mask), expected, mask)
    assert_logits_close(forward_layerwise(model, params, ids, mask, batch_size=1), expected, mask)


def test_expected_shapes_name_every_tensor_of_the_transformers_checkpoint(tiny):
    _, config, params = tiny
    assert build(config).expected_shapes() == {name: tuple(array.shape) for name, array in params.items()}


def test_quantized_linears_are_attention_experts_shared_experts_and_dense_mlp_not_the_router(tiny):
    _, config, params = tiny
    q = (("q_a_proj", "q_b_proj") if config["q_lora_rank"] else ("q_proj",))
    attention = {f"model.layers.{i}.self_attn.{x}" for i in range(2)
                 for x in (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}
    swiglu = ("gate_proj", "up_proj", "down_proj")
    feed_forward = ({f"model.layers.0.mlp.{x}" for x in swiglu}
                    | {f"model.layers.1.mlp.experts.{e}.{x}" for e in range(4) for x in swiglu}
                    | {f"model.layers.1.mlp.shared_experts.{x}" for x in swiglu})
    assert set(family_for(config).linear_names(params)) == attention | feed_forward


def test_kv_b_proj_value_rows_feed_o_proj_and_its_key_rows_keep_scale_1(tiny):
    _, config, params = tiny
    heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    group = next(g for g in build(config).linear_smoothing_groups() if g.source.endswith("1.self_attn.kv_b_proj"))
    assert group.linears == ("model.layers.1.self_attn.o_proj",)
    # o_proj's input column h * v + j is head h's value channel j: kv_b_proj's row h * (nope + v) + nope + j.
    rows = [h * (nope + v) + nope + j for h in range(heads) for j in range(v)]
    assert [group.source_offset + c for c in channel_map(group, heads * v)] == rows
    act = np.random.default_rng(0).uniform(0.1, 30.0, heads * v).astype(np.float32)
    scales = group_scales(group, act, [params[f"{group.linears[0]}.weight"]], alpha=0.85)
    by_row = np.ones(heads * (nope + v), np.float32)
    by_row[group.source_offset:group.source_offset + len(scales.source_scales)] = scales.source_scales
    assert not np.allclose(by_row[rows], 1.0)
    np.testing.assert_array_equal(np.delete(by_row, rows), 1.0)  # the key rows: the attention scores unchanged


def test_smoothing_groups_fold_without_changing_the_float_model(tiny):
    """Fold arbitrary positive scales into every group as SmoothQuant does (the source's output channels divide
    by s, the linears' input columns multiply by s; source rows no input reads keep 1): the logits stay the same."""
    _, config, params = tiny
    model = build(config)
    groups = model.smoothing_groups() + model.linear_smoothing_groups()
    sources = {g.source.removeprefix("model.layers.1.") for g in groups if g.source.startswith("model.layers.1.")}
    latent = {"self_attn.q_a_layernorm"} if config["q_lora_rank"] else set()
    assert {"input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
            "mlp.shared_experts.up_proj", "mlp.experts.3.up_proj"} | latent <= sources
    rng = np.random.default_rng(0)
    smoothed, covered = dict(params), set()
    for group in groups:
        index = channel_map(group, params[f"{group.linears[0]}.weight"].shape[1])
        s = np.ones(int(index.max()) + 1, np.float32)
        s[index] = rng.uniform(0.25, 4.0, size=len(index)).astype(np.float32)
        w = smoothed[f"{group.source}.weight"].copy()
        rows = slice(group.source_offset, group.source_offset + len(s))
        w[rows] = w[rows] / (s if w.ndim == 1 else s[:, None])
        smoothed[f"{group.source}.weight"] = w
        for linear in group.linears:
            smoothed[f"{linear}.weight"] = smoothed[f"{linear}.weight"] * s[index][None, :]
            covered.add(linear)
    linears = set(model.linear_names(params))
    assert linears <= covered and covered - linears == {"model.layers.1.mlp.gate"}  # the router absorbs s, float
    ids, mask = token_batch(config["vocab_size"])
    forward = jax.jit(model.forward)
    assert_logits_close(forward(smoothed, ids, mask), np.asarray(forward(params, ids, mask)), mask, rtol=1e-4)


def test_yarn_rope_matches_transformers_on_another_family(tmp_path):
    """yarn's frequencies and its cos/sin gain (0.1 ln(factor) + 1 without mscale) are RoPE's, not DeepSeek's."""
    folder = make_hf_checkpoint(tmp_path, "qwen3", layers=1, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0})
    config = load_config(folder)
    ids, mask = token_batch(config["vocab_size"])
    got = jax.jit(build(config).forward)(load_file(str(folder / "model.safetensors")), ids, mask)
    assert_logits_close(got, reference_logits(folder, ids, mask), mask)


@pytest.mark.parametrize("edit, error, words", [
    ({"n_group": 3}, InvalidCheckpointError, "n_group = 3 does not divide n_routed_experts = 4"),
    ({"n_group": 4}, InvalidCheckpointError, "n_group = 4 leaves 1 expert per group"),
    ({"topk_group": 3}, InvalidCheckpointError, "topk_group = 3 exceeds n_group = 2"),
    ({"num_experts_per_tok": 3}, InvalidCheckpointError, "num_experts_per_tok = 3 exceeds the 2 experts"),
    ({"qk_rope_head_dim": 7}, InvalidCheckpointError, "qk_rope_head_dim is 7"),
    ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": -1}}, InvalidCheckpointError,
     "rope_parameters.mscale_all_dim is -1"),
])
def test_a_config_that_does_not_fit_is_refused_naming_the_key(tiny, edit, error, words):
    _, config, _ = tiny
    with pytest.raises(error, match=words):
        build({**config, **edit})


# config.json fields of the released DeepSeek-V3 (also R1 and V3.1) and of a config shaped like Kimi-K2's (model_type
# kimi_k2, 64 heads, 384 experts in one group, yarn with beta_fast = beta_slow = 1), at full size: no weights.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
           "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
           "routed_scaling_factor": 2.827, "vocab_size": 163840, "max_position_embeddings": 131072,
           "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
           "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"}}


@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K2], ids=["deepseek-v3", "kimi-k2"])
def test_released_configs_rope_and_softmax_scale_are_transformers(config):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

    from qconvert.models.rope import attention_factor, inverse_frequencies

    hf = transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    rotary = DeepseekV3RotaryEmbedding(hf)
    model = build(config)
    np.testing.assert_allclose(inverse_frequencies(model.args.rope, model.mla.qk_rope_head_dim),
                               rotary.inv_freq.numpy(), rtol=1e-6)
    assert attention_factor(model.args.rope) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert model.mla.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** -0.5),
                                                    rel=1e-12)
    first = config["first_k_dense_replace"]
    assert model.moe.sparse_layers == tuple(i >= first for i in range(61))
    assert len(model.layer_linears(first)) == 5 + 1 + 3 * config["n_routed_experts"] + 3
