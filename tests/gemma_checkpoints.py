"""Tiny random Gemma 2 / Gemma 3 checkpoints built with transformers itself (test-only: imports torch)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

# Gemma 2: layers 0 and 2 slide (window 4 < the tests' 12 tokens), layer 1 is global;
# the caps are small enough that tanh bends the random model's scores and logits.
GEMMA2 = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=96, intermediate_size=160,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
              query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=1.5,
              final_logit_softcapping=2.5, tie_word_embeddings=True, max_position_embeddings=64)
# Gemma 3: q/k norms, a local RoPE base for the sliding layers and linear RoPE scaling
# on the global one, an untied head.
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=96, intermediate_size=160,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
              query_pre_attn_scalar=24, sliding_window=4, tie_word_embeddings=False, max_position_embeddings=64,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def make_gemma_checkpoint(folder, fields: dict, *, seed: int = 0, **overrides) -> Path:
    """Save a transformers-built Gemma model with random weights (norm gains too) as safetensors."""
    folder = Path(folder)
    fields = {**fields, **overrides}
    config = transformers.AutoConfig.for_model(fields["model_type"], **{
        k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
    config.architectures = fields["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # Gemma's gain is 1 + w: spread w around 0
                p.copy_(torch.randn_like(p) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def reference_logits(folder, ids, mask=None, weights: dict | None = None):
    """transformers' float32 logits for ids [B, T]; `weights` (numpy) replace the checkpoint's first."""
    import numpy as np

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if weights:
        state = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in weights.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask, dtype=torch.long)}
        return model(input_ids=torch.tensor(ids, dtype=torch.long), **kwargs).logits.numpy()


def read_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def with_outlier_channels(folder, channels=(5, 40), factor: float = 60.0) -> Path:
    """Store the checkpoint in bfloat16 (as Gemma ships) with the embedding's `channels` scaled by `factor`:
    the residual stream then carries outlier channels into every norm, where SmoothQuant's s grows large."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    embed = tensors["model.embed_tokens.weight"]
    embed[:, list(channels)] *= factor
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(path),
              metadata={"format": "pt"})
    config = read_config(folder)
    config["torch_dtype"] = "bfloat16"
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))
    return Path(folder)


# Gemma 3 multimodal (Gemma3ForConditionalGeneration): a tiny Gemma 3 text model (sliding layer 0, global layer 1
# with linear RoPE scaling, q/k norms) beside a tiny SigLIP tower (2 layers, 16 patches pooled to 4 image tokens).
GEMMA3_MM_TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128, query_pre_attn_scalar=24, sliding_window=4,
                      max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                          "rope_theta": 1_000_000.0},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
GEMMA3_MM_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        image_size=32, patch_size=8, vision_use_head=False)
# The same as a config.json (no weights), for the registry's tests.
GEMMA3_MM = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", mm_tokens_per_image=4,
                 text_config={**GEMMA3_MM_TEXT, "model_type": "gemma3_text"},
                 vision_config={**GEMMA3_MM_VISION, "model_type": "siglip_vision_model"})
# Where each layout puts the language model, the SigLIP tower and the projector, from the names transformers'
# save_pretrained writes: the Hub's (google/gemma-3-4b-it), and transformers 4.52-4.57's.
GEMMA3_MM_LAYOUTS = {
    "hub": (("vision_tower.", "vision_tower.vision_model."),),
    "model": (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower.vision_model."),
              ("multi_modal_projector.", "model.multi_modal_projector.")),
}


def make_gemma3_multimodal_checkpoint(folder, layout: str = "hub", *, seed: int = 0, text: dict | None = None) -> Path:
    """Save a transformers-built Gemma3ForConditionalGeneration with random weights (every tensor drawn, the
    vision tower and projector too), its tensors renamed into `layout`'s names."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**{**GEMMA3_MM_TEXT, **(text or {})}),
        vision_config=transformers.SiglipVisionConfig(**GEMMA3_MM_VISION),
        mm_tokens_per_image=4, boi_token_index=125, eoi_token_index=126, image_token_index=127)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:  # Gemma's gain is 1 + w
                p.copy_(torch.randn_like(p) * 0.3)
            elif "embed_tokens" in name:  # also the tied head: the residual's own token leads, as in trained LMs
                p.copy_(torch.randn_like(p) * 0.15)
            else:
                p.copy_(torch.randn_like(p) * 0.08)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(str(folder))
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in GEMMA3_MM_LAYOUTS[layout]:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        renamed[name] = tensor
    save_file(renamed, str(path), metadata={"format": "pt"})
    return folder


def multimodal_logits(folder, ids, mask=None):
    """transformers' float32 logits of Gemma3ForConditionalGeneration in `folder` on text-only input ids [B, T]
    (a quantized folder through its quantization_config), every tensor of the folder read into the model (the
    vision tower's too, which text input does not reach) and none of the model's left unread."""
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    from hf_checkpoints import generic_bitsandbytes_path

    model = generic_bitsandbytes_path(model.eval())
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask, dtype=torch.long)}
        return model(input_ids=torch.tensor(ids, dtype=torch.long), **kwargs).logits.numpy()
