"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, tiny, built by transformers): the text forward
matches transformers' logits for that class in both tensor layouts."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gemma_checkpoints import make_gemma3_multimodal_checkpoint, multimodal_logits, read_config  # noqa: E402
from qconvert.formats.errors import InvalidCheckpointError  # noqa: E402
from qconvert.models import Gemma3MultimodalModel, GemmaModel, build, forward_layerwise  # noqa: E402
from qconvert.models.registry import language_config  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
IDS = np.random.default_rng(1).integers(0, 125, size=(2, 12))  # 12 tokens > the sliding window of 4
MASK = np.ones_like(IDS)
MASK[1, -3:] = 0
VALID = MASK.astype(bool)
# Measured max abs diff ~4e-6 on logits of scale ~15 (both layouts); the text families' bound (test_models_gemma.py).
RTOL = 1e-5


@pytest.fixture(scope="module")
def hub_source(tmp_path_factory):
    """The Hub's layout (google/gemma-3-4b-it's names), as vLLM reads it."""
    return make_gemma3_multimodal_checkpoint(tmp_path_factory.mktemp("hub") / "src", "hub")


@pytest.mark.parametrize("layout", ["hub", "model"])
def test_text_forward_matches_transformers_multimodal_class_in_both_layouts(layout, hub_source, tmp_path):
    # The "model" layout (transformers 4.52-4.57's names) with a final_logit_softcapping in text_config, which
    # Gemma3ForConditionalGeneration does not apply (Gemma3ForCausalLM would).
    folder = hub_source if layout == "hub" else make_gemma3_multimodal_checkpoint(
        tmp_path / "src", layout, seed=3, text={"final_logit_softcapping": 2.0})
    expected = multimodal_logits(folder, IDS, MASK)
    params = load_file(str(folder / "model.safetensors"))
    model = build(read_config(folder), params)
    assert isinstance(model, Gemma3MultimodalModel)
    assert model.prefix == {"hub": "language_model.model", "model": "model.language_model"}[layout]
    scale = np.abs(expected[VALID]).max()
    for got in (jax.jit(model.forward)(params, IDS, MASK), forward_layerwise(model, params, IDS, MASK, batch_size=1)):
        assert np.abs(np.asarray(got)[VALID] - expected[VALID]).max() <= RTOL * scale
    if layout == "model":  # the soft-cap would have moved the logits: the parity above says it is not applied
        capped = GemmaModel(dataclasses.replace(model.args, final_logit_softcapping=2.0), prefix=model.prefix,
                            lm_head=model.lm_head)
        assert np.abs(np.asarray(capped.forward(params, IDS, MASK))[VALID] - expected[VALID]).max() > 0.3 * scale


def test_hub_text_config_takes_transformers_defaults_for_what_it_leaves_out():
    # google/gemma-3-4b-it's config.json gives only these text_config keys; transformers fills the rest.
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                              "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                              "sliding_window": 1024},
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
              "mm_tokens_per_image": 256, "image_token_index": 262144}
    args = Gemma3MultimodalModel.from_config(config).args
    text = transformers.Gemma3Config(**{k: v for k, v in config.items() if k != "architectures"}).text_config
    assert (args.vocab_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
            args.query_pre_attn_scalar, args.rms_norm_eps, args.hidden_activation) == (
        text.vocab_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
        text.query_pre_attn_scalar, text.rms_norm_eps, text.hidden_activation)
    assert list(args.layer_types) == text.layer_types and args.sliding_window == text.sliding_window == 1024
    full, sliding = args.ropes[5], args.ropes[0]
    assert args.layer_types[5] == "full_attention" and args.layer_types[0] == "sliding_attention"
    assert (full.theta, full.rope_type, full.factor) == (text.rope_parameters["full_attention"]["rope_theta"],
                                                         "linear", 8.0)
    assert sliding.theta == text.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert args.tie_word_embeddings and args.final_logit_softcapping is None
    # What calibration reads for --calib random and the window cap.
    language = language_config(config)
    assert (language["vocab_size"], language["max_position_embeddings"]) == (text.vocab_size,
                                                                            text.max_position_embeddings)


@pytest.mark.parametrize("change, message", [
    ({"text_config": {"hidden_size": "wide"}}, "text_config.hidden_size"),
    ({"text_config": {"model_type": "llama"}}, "text_config.model_type"),
    ({"text_config": [1, 2]}, "text_config is"),
])
def test_a_bad_text_config_is_an_invalid_checkpoint_naming_the_key(change, message):
    with pytest.raises(InvalidCheckpointError, match=f"^config\\.json: {message.replace('.', '[.]')}"):
        build({"architectures": ["Gemma3ForConditionalGeneration"], **change})


def test_the_family_names_only_the_language_models_linears():
    # SigLIP's encoder layers have q/k/v_proj under `layers.N.self_attn` too.
    names = [f"{p}.layers.0.{m}.weight" for p in ("language_model.model", "model.language_model") for m in LINEARS]
    vision = [f"vision_tower.vision_model.encoder.layers.0.self_attn.{m}.weight" for m in ("q_proj", "k_proj")]
    assert Gemma3MultimodalModel.linear_names(names + vision) == sorted(n[:-len(".weight")] for n in names)
