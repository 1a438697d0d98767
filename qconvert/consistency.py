"""config.json against the weights, before anything is written: every tensor the family reads is there with
the shape the config implies, and no layer tensor goes unread."""

from __future__ import annotations

import re
from typing import Any

from qconvert.errors import InvalidCheckpointError
from qconvert.formats.safetensors_io import SafetensorsCheckpoint

# Buffers some checkpoints carry inside their layers that no forward reads as weights (RoPE is recomputed).
HARMLESS_LAYER_TENSORS = (re.compile(r"\.rotary_emb\.inv_freq$"),)
_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "num_local_experts", "max_position_embeddings", "type_vocab_size")


def _config_summary(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={config[k]}" for k in _CONFIG_KEYS if k in config)


def check_weights_match_config(ckpt: SafetensorsCheckpoint, config: dict[str, Any]):
    """Raise InvalidCheckpointError (exit 6), one line naming the tensor or key, where config.json and the
    weights disagree. Returns the family's model (what `qconvert.models.build(config)` gives)."""
    from qconvert.models import build

    model = build(config)  # config values of the wrong type or inconsistent ones raise here
    expected = model.expected_shapes()
    for name, shape in expected.items():
        if name not in ckpt:
            raise InvalidCheckpointError(
                f"{name} is missing from the weights, but config.json ({model.num_layers} layers) needs it")
        actual = tuple(ckpt.shape(name))
        if actual != tuple(shape):
            raise InvalidCheckpointError(
                f"{name} has shape {list(actual)}, but config.json implies {list(shape)} "
                f"({_config_summary(config)}); the config does not fit the weights")
    prefix = getattr(model, "layers_prefix", None)
    if prefix:
        for name in ckpt.tensor_names:
            if (name.startswith(prefix) and name not in expected
                    and not any(p.search(name) for p in HARMLESS_LAYER_TENSORS)):
                raise InvalidCheckpointError(
                    f"{name} is in the weights but not read by the model config.json describes "
                    f"(num_hidden_layers={model.num_layers}); the config does not fit the weights")
    return model
