"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, the 4B/12B/27B models): the language model
is Gemma 3 text, calibrated and quantized as such; the SigLIP vision tower and the projector stay float.

config.json nests the language model's config under `text_config` (the vision tower's under `vision_config`).
The language model's tensors lie under one of two prefixes, by who saved the checkpoint: `language_model.model.`
(the Hub's checkpoints, and transformers' save_pretrained, which writes that layout back) or
`model.language_model.` (transformers 4.52-4.57, whose save did not); the checkpoint's own names are read and
written back unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.models.config_values import config_bool
from qconvert.models.gemma import GemmaArgs, GemmaModel

ARCHITECTURE = "Gemma3ForConditionalGeneration"
TEXT_MODEL_TYPE = "gemma3_text"
# Gemma3TextConfig's defaults (transformers), which a Hub text_config leaves out: google/gemma-3-4b-it gives
# only its sizes, layer count, sliding window and RoPE scaling, and relies on these for the rest.
TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": TEXT_MODEL_TYPE, "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "attention_bias": False,
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a checkpoint keeps the language model: its decoder's prefix and its untied head's module."""

    language: str
    lm_head: str


# The Hub's layout first: it is also what transformers' save_pretrained writes, so a model built from
# config.json alone (no tensor names to read) takes it.
LAYOUTS = (Layout("language_model.model", "language_model.lm_head"), Layout("model.language_model", "lm_head"))
# The sub-models no loader quantizes: a SigLIP tower is the vision model's own (vLLM builds it with its
# own module names), and the projector holds a bare matrix, no linear. `model.` prefixes them in
# transformers' module names (since 4.52), not in vLLM's.
FLOAT_TOWERS = (r"(model\.)?vision_tower\.", r"(model\.)?multi_modal_projector\.")


@dataclasses.dataclass(frozen=True)
class Gemma3MultimodalModel(GemmaModel):
    """Gemma3ForConditionalGeneration's language model on text input, as pure functions of `params`.

    As transformers runs it: Gemma 3 text's decoder (scaled embeddings, sliding and global layers, q/k
    norms), and the head without a final soft-cap (the class applies none, whatever text_config's
    final_logit_softcapping says). The head is tied unless config.json's own tie_word_embeddings is false.
    """

    family = "gemma3_mm"
    hf_architectures = (ARCHITECTURE,)
    float_towers = FLOAT_TOWERS

    prefix: str = LAYOUTS[0].language
    lm_head: str = LAYOUTS[0].lm_head

    @classmethod
    def language_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """text_config with Gemma3TextConfig's defaults under it (InvalidCheckpointError for one that is not
        Gemma 3 text's)."""
        text = config.get("text_config")
        if text is None:
            text = {}
        if not isinstance(text, dict):
            raise InvalidCheckpointError(f"config.json: text_config is {text!r}; it must be an object (the "
                                         "language model's config)")
        if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
            raise InvalidCheckpointError(f"config.json: text_config.model_type is {text['model_type']!r}; "
                                         f"{ARCHITECTURE} has a {TEXT_MODEL_TYPE!r} language model")
        return {**TEXT_DEFAULTS, **text}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Gemma3MultimodalModel":
        return cls.from_checkpoint(config, ())

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any], tensor_names: Iterable[str]) -> "Gemma3MultimodalModel":
        """The model under the prefix the checkpoint's embedding table names (the Hub's layout when none does)."""
        text = cls.language_config(config)
        try:
            args = GemmaArgs.from_config(text)
        except InvalidCheckpointError as err:  # the key is text_config's
            raise InvalidCheckpointError(str(err).replace("config.json: ", "config.json: text_config.", 1)
                                         ) from None
        args = dataclasses.replace(args, final_logit_softcapping=None,
                                   tie_word_embeddings=config_bool(config, "tie_word_embeddings", True))
        names = set(tensor_names)
        layout = next((lay for lay in LAYOUTS if f"{lay.language}.embed_tokens.weight" in names), LAYOUTS[0])
        return cls(args, prefix=layout.language, lm_head=layout.lm_head)

    @classmethod
    def linear_names(cls, tensor_names: Iterable[str]) -> list[str]:
        """The language model's linears (the vision tower's encoder layers have q/k/v_proj too)."""
        stacks = tuple(f"{lay.language}.{cls.LAYER_STACK}." for lay in LAYOUTS)
        return [m for m in super().linear_names(tensor_names) if m.startswith(stacks)]
