"""The family registry: each family's facts (causal LM, linears, remedy, activation table) against
transformers' own tables and against the family's forward and smoothing groups."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from gemma_checkpoints import GEMMA2, GEMMA3, GEMMA3_MM
from hf_checkpoints import TINY
from qconvert.formats.errors import UnsupportedModelError
from qconvert.models import build
from qconvert.models.activations import ACTIVATIONS
from qconvert.models.family import REMEDY_LEAD, DecoderHooks, Family
from qconvert.models.registry import FAMILIES, family_for
from model_configs import CASES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_config(family: str) -> dict:
    config_class, fields = TINY[family]
    config = getattr(transformers, config_class)(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **fields).to_dict()
    config["architectures"] = [{"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                "deepseek_v3": "DeepseekV3ForCausalLM"}[family]]
    return config


# One tiny config.json per supported Hugging Face architecture.
CONFIGS = {
    "LlamaForCausalLM": CASES["llama"], "MistralForCausalLM": CASES["mistral"], "Qwen2ForCausalLM": CASES["qwen2"],
    "MixtralForCausalLM": CASES["mixtral"], "BertModel": CASES["bert"],
    "Gemma2ForCausalLM": GEMMA2, "Gemma3ForCausalLM": GEMMA3, "Gemma3ForConditionalGeneration": GEMMA3_MM,
    **{_tiny_config(f)["architectures"][0]: _tiny_config(f)
       for f in ("qwen3", "phi3", "qwen2_moe", "qwen3_moe", "deepseek_v3")},
    "GptOssForCausalLM": {**transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False).to_dict(), "architectures": ["GptOssForCausalLM"]},
}
ROUTERS = re.compile(r"(\.gate|\.shared_expert_gate|\.router)$")


def test_every_supported_architecture_has_a_test_config():
    assert sorted(CONFIGS) == sorted(a for family in FAMILIES for a in family.hf_architectures)


def test_each_architecture_name_belongs_to_one_family():
    names = [a for family in FAMILIES for a in family.hf_architectures]
    assert len(names) == len(set(names))
    assert len({family.family for family in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_causal_lm_is_what_transformers_maps_as_a_causal_lm(name):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    assert family_for(CONFIGS[name]).causal_lm is causal


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_linears_are_the_forward_linears_except_routers(name):
    """The family's per-layer linear names give both the forward's calls and the quantized pattern."""
    config = CONFIGS[name]
    family, model = family_for(config), build(config)
    assert type(model) is family
    called = {m for i in range(model.num_layers) for m in model.layer_linears(i)}
    quantized = set(family.linear_names(model.expected_shapes()))
    assert quantized == {m for m in called if not ROUTERS.search(m)}
    assert all(f"{m}.weight" in model.expected_shapes() for m in called)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_family_is_one_class_answering_the_family_protocol(name):
    config = CONFIGS[name]
    model = build(config)
    assert isinstance(model, Family)
    assert type(model) is family_for(config) and name in type(model).hf_architectures
    if type(model).causal_lm:  # the decoders: Llama's layer with its override points
        assert isinstance(model, DecoderHooks)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_smoothing_groups_are_named_under_the_models_own_layer_prefix(name):
    """A checkpoint that nests the model (BERT under "bert.", a decoder under another prefix) gets its
    groups named there: the prefix comes from the model, never from the family's code."""
    model = build(CONFIGS[name])
    moved = dataclasses.replace(model, prefix="bert." if name == "BertModel" else "language_model.model")
    groups = moved.smoothing_groups() + moved.linear_smoothing_groups()
    assert groups and len(groups) == len(model.smoothing_groups() + model.linear_smoothing_groups())
    modules = {n[: -len(".weight")] for n in moved.expected_shapes() if n.endswith(".weight")}
    for group in groups:
        assert group.source.startswith(moved.layers_prefix)
        assert {group.source, *group.linears} <= modules


def _module_words(remedy: str) -> set[str]:
    """The module names a remedy text mentions (words like v_proj, w3, attention.self.value)."""
    words = re.split(r"[\s,;:()]+", remedy[len(REMEDY_LEAD):])
    return {w for w in words if re.fullmatch(r"[a-z0-9_.]+", w) and ("_" in w or "." in w or re.fullmatch(r"w\d", w))}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_remedy_names_the_familys_own_linear_groups(name):
    """Every module the recorded remedy names is one of this family's modules, and every
    linear -> linear group's source and consumer is named (BERT, Mixtral and Phi-3 have no
    v_proj or up_proj)."""
    config = CONFIGS[name]
    model = build(config)
    assert model.remedy.startswith(REMEDY_LEAD)
    modules = {n[: -len(".weight")] for n in model.expected_shapes() if n.endswith(".weight")}
    words = _module_words(model.remedy)
    assert words
    for word in words:
        assert any(m.endswith(f".{word}") for m in modules), f"{model.family} remedy names {word!r}"
    for group in model.linear_smoothing_groups():
        for module in (group.source, *group.linears):
            assert any(module.endswith(f".{word}") for word in words), f"{module} not in {model.remedy!r}"


def test_llamas_remedy_text_is_unchanged():
    # Recorded in every Llama w8a8 qconvert.json since the first release; converted folders compare it.
    assert family_for(CASES["llama"]).remedy == (
        "linear->linear smoothing of the inputs no norm feeds: v_proj rows -> o_proj columns "
        "(one scale per KV-head channel, shared by the query heads of its group), "
        "up_proj rows -> down_proj columns")


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_activation_table_matches_transformers(activation):
    from transformers.activations import ACT2FN

    x = np.linspace(-8, 8, 4001, dtype=np.float32)
    expected = ACT2FN[activation](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(ACTIVATIONS[activation](x)), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name, key", [("LlamaForCausalLM", "hidden_act"), ("BertModel", "hidden_act"),
                                       ("Gemma2ForCausalLM", "hidden_activation"), ("Phi3ForCausalLM", "hidden_act")])
def test_an_activation_outside_the_table_is_refused_naming_the_key(name, key):
    config = {**CONFIGS[name], key: "relu2"}
    with pytest.raises(UnsupportedModelError, match=f"{key} 'relu2' is not supported; supported: silu, gelu"):
        build(config)
