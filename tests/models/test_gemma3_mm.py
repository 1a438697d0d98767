"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, tiny, built by transformers): the text forward
matches transformers' logits for that class in both tensor layouts; int4 and w8a8 folders quantize the language
model only, pass verify, keep the vision tower and projector byte for byte, and load in transformers +
compressed-tensors as the multimodal class, close to the float model on text input."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from cli_helpers import run as run_cli  # noqa: E402
from gemma_checkpoints import (GEMMA3_MM, make_gemma3_multimodal_checkpoint, multimodal_logits,  # noqa: E402
                               read_config)
from hf_checkpoints import dequantized_float_folder  # noqa: E402
from qconvert.formats.errors import InvalidCheckpointError  # noqa: E402
from qconvert.calibration.layers import forward_layerwise  # noqa: E402
from qconvert.models import Gemma3MultimodalModel, GemmaModel, build  # noqa: E402
from qconvert.models.registry import language_config  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# w8a8 calibrates the language model on text (SmoothQuant); int4 rounds to nearest, the quickest folder of its layout.
FLAGS = {"w8a8": ("--calib", "random", "--calib-samples", "4", "--calib-seqlen", "32"), "int4": ("--no-gptq", "--no-awq",)}
IDS = np.random.default_rng(1).integers(0, 125, size=(2, 12))  # 12 tokens > the sliding window of 4
MASK = np.ones_like(IDS)
MASK[1, -3:] = 0
VALID = MASK.astype(bool)
# Measured max abs diff ~4e-6 on logits of scale ~15 (both layouts); the text families' bound (test_models_gemma.py).
RTOL = 1e-5


def cosine(a, b) -> float:
    a, b = a[VALID].ravel().astype(np.float64), b[VALID].ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def tensor_bytes(folder) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
                for name in f.keys() for t in [f.get_tensor(name)]}


@pytest.fixture(scope="module")
def hub_source(tmp_path_factory):
    """The Hub's layout (google/gemma-3-4b-it's names), as vLLM reads it."""
    return make_gemma3_multimodal_checkpoint(tmp_path_factory.mktemp("hub") / "src", "hub")


@pytest.fixture(scope="module")
def converted(hub_source, tmp_path_factory):
    """scheme -> its folder, converted once."""
    root, outs = tmp_path_factory.mktemp("outs"), {}

    def convert(scheme, capsys):
        if scheme not in outs:
            code, _, err = run_cli(["quantize", str(hub_source), "-o", str(root / scheme), "--scheme", scheme, "-q",
                                    *FLAGS[scheme]], capsys)
            assert code == 0, err
            outs[scheme] = root / scheme
        return outs[scheme]
    return convert


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


def test_the_servers_table_does_not_lend_gemma3_texts_verdicts_to_the_multimodal_class():
    from qconvert.schemes.servers import UNMEASURED, YES, family_of, servers

    text, multimodal = family_of({"model_type": "gemma3_text"}), family_of(GEMMA3_MM)
    assert servers("w8a8", text)["vLLM TPU"] == YES  # measured on Gemma3ForCausalLM only
    assert servers("w8a8", multimodal) == {"vLLM GPU": UNMEASURED, "vLLM TPU": UNMEASURED,
                                           "vLLM TPU MODEL_IMPL_TYPE=vllm": UNMEASURED, "transformers": YES}


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


@pytest.mark.parametrize("scheme, floor", [("int4", 0.95), ("w8a8", 0.995)])
def test_folder_verifies_keeps_the_vision_tower_and_loads_as_the_multimodal_class(scheme, floor, hub_source,
                                                                                  converted, capsys, tmp_path):
    out = converted(scheme, capsys)
    code, report, err = run_cli(["verify", str(out), "--quick", "--backend", "cpu", "--json", "-"], capsys)
    assert code == 0, err
    record = json.loads(report)
    assert record["passed"] and record["model"]["kind"] == "causal_lm"
    assert {r["name"] for r in record["layers"]} == {f"language_model.model.layers.{i}.{m}"
                                                     for i in range(2) for m in LINEARS}

    source_config, config = read_config(hub_source), read_config(out)
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config
    assert config["quantization_config"]["ignore"] == [
        "lm_head", r"re:(model\.)?vision_tower\.", r"re:(model\.)?multi_modal_projector\."]
    source_tensors, written = tensor_bytes(hub_source), tensor_bytes(out)
    kept = [name for name in source_tensors if not name.startswith("language_model.")]
    assert len(kept) == 39 and any(n.endswith("mm_input_projection_weight") for n in kept)
    assert {name: written[name] for name in kept} == {name: source_tensors[name] for name in kept}

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32)
    vision_q = model.model.vision_tower.encoder.layers[0].self_attn.q_proj
    assert not hasattr(vision_q, "quantization_scheme")
    assert hasattr(model.model.language_model.layers[0].self_attn.q_proj, "quantization_scheme")
    loaded, float_logits = multimodal_logits(out, IDS, MASK), multimodal_logits(hub_source, IDS, MASK)
    assert cosine(loaded, float_logits) >= floor
    if scheme == "int4":  # transformers reads the codes as qconvert means them (w8a8: it quantizes activations too)
        meant = multimodal_logits(dequantized_float_folder(hub_source, out, tmp_path / "meant"), IDS, MASK)
        assert np.abs(loaded[VALID] - meant[VALID]).max() <= 1e-4 * np.abs(meant[VALID]).max()


def test_model_layout_converts_under_its_own_names_and_loads_with_bitsandbytes(tmp_path, capsys):
    # transformers 4.52-4.57's names, and nf4: bitsandbytes reads its skip list as regular expressions.
    source = make_gemma3_multimodal_checkpoint(tmp_path / "src", "model", seed=4)
    out = tmp_path / "nf4"
    code, _, err = run_cli(["quantize", str(source), "-o", str(out), "--scheme", "nf4", "-q"], capsys)
    assert code == 0, err
    assert read_config(out)["quantization_config"]["llm_int8_skip_modules"] == [
        "lm_head", r"(model\.)?vision_tower\.", r"(model\.)?multi_modal_projector\."]
    source_tensors, written = tensor_bytes(source), tensor_bytes(out)
    assert {f"model.language_model.layers.1.{m}.weight.absmax" for m in LINEARS} <= set(written)
    kept = [name for name in source_tensors if not name.startswith("model.language_model.")]
    assert all(name.startswith(("model.vision_tower.vision_model.", "model.multi_modal_projector.")) for name in kept)
    assert {name: written[name] for name in kept} == {name: source_tensors[name] for name in kept}
    loaded = multimodal_logits(out, IDS, MASK)
    assert cosine(loaded, multimodal_logits(source, IDS, MASK)) >= 0.95


def test_an_include_of_vision_linears_alone_is_refused(hub_source, tmp_path, capsys):
    code, out, err = run_cli(["quantize", str(hub_source), "-o", str(tmp_path / "x"), "--include", "*.fc1"], capsys)
    assert (code, out) == (2, "")
    assert err == ("qconvert: error: --include *.fc1 matches only linears of the vision tower or projector "
                   "(vision_tower.vision_model.encoder.layers.0.mlp.fc1), which stay float with the rest of their "
                   "sub-model; only the language model is quantized\n")
    assert not (tmp_path / "x").exists()
