"""config.json against the weights, before anything is written: every tensor the family reads is there with
the shape the config implies, and no layer tensor goes unread."""

from __future__ import annotations

import re
from typing import Any, Callable

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats.safetensors_io import SafetensorsCheckpoint

# Buffers some checkpoints carry inside their layers that no forward reads as weights (RoPE is recomputed).
HARMLESS_LAYER_TENSORS = (re.compile(r"\.rotary_emb\.inv_freq$"),)
_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "num_local_experts", "max_position_embeddings", "type_vocab_size")


# Config integers bounded by the weights: layers by the blocks the weights number (model.layers.N.),
# experts by the same or, stored fused, a tensor dimension; sizes by the largest tensor dimension.
_DIMENSION_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                   "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "type_vocab_size",
                   "num_experts_per_tok")
_NUMBERED = re.compile(r"(?:^|\.)([0-9]+)\.")


def _bounded(config: dict[str, Any], bounds: dict[str, tuple[int, str]]) -> None:
    for key, (bound, what) in bounds.items():
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            raise InvalidCheckpointError(f"config.json: {key} is {value}, but the weights hold {what}; "
                                         "the config does not fit the weights")


def check_config_counts(ckpt: SafetensorsCheckpoint, config: dict[str, Any]) -> None:
    """Bound config.json's layer and expert counts by what the weights hold, before anything is built per
    layer: a config that claims 10^12 layers is refused here (exit 6, naming the key) instead of sending
    the family into a loop over layers that do not exist."""
    numbered = max((int(m.group(1)) + 1 for name in ckpt.tensor_names for m in _NUMBERED.finditer(name)),
                   default=0)
    experts = max(numbered, _largest_extent(ckpt))  # experts may be stored fused, along a dimension
    for values in _configs(config):
        _bounded(values, {"num_hidden_layers": (numbered, f"{numbered} numbered blocks"),
                          "num_local_experts": (experts, f"{experts} experts at most"),
                          "num_experts": (experts, f"{experts} experts at most"),
                          "n_routed_experts": (experts, f"{experts} experts at most")})


def check_config_sizes(ckpt: SafetensorsCheckpoint, config: dict[str, Any]) -> None:
    """Every size config.json gives is at most the largest tensor dimension (a backstop for the sizes no
    expected shape names)."""
    extent = _largest_extent(ckpt)
    for values in _configs(config):
        _bounded(values, {key: (extent, f"no tensor dimension above {extent}") for key in _DIMENSION_KEYS})


def _configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """config.json, and a multimodal checkpoint's nested text_config (where its language model's sizes are)."""
    text = config.get("text_config")
    return [config, text] if isinstance(text, dict) else [config]


def _largest_extent(ckpt: SafetensorsCheckpoint) -> int:
    return max((max(ckpt.shape(name), default=1) for name in ckpt.tensor_names), default=0)


def _config_summary(config: dict[str, Any]) -> str:
    return ", ".join(f"{k}={config[k]}" for k in _CONFIG_KEYS if k in config)


def check_weights_match_config(ckpt: SafetensorsCheckpoint, config: dict[str, Any],
                               model_of: Callable[[], Any] | None = None):
    """Raise InvalidCheckpointError (exit 6), one line naming the tensor or key, where config.json and the
    weights disagree. Returns the family's model: `model_of()` (the command's one build, e.g.
    SourceModel.model), by default `qconvert.models.build(config)`."""
    if model_of is None:
        from qconvert.models import build

        def model_of():
            return build(config, ckpt.tensor_names)

    check_config_counts(ckpt, config)
    model = model_of()  # config values of the wrong type or inconsistent ones raise here
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
    # Layers a family knows it does not run (DeepSeek-V3's multi-token prediction), written unchanged.
    carried = model.carried_tensors(ckpt.tensor_names) if hasattr(model, "carried_tensors") else set()
    if prefix:
        for name in ckpt.tensor_names:
            if (name.startswith(prefix) and name not in expected and name not in carried
                    and not any(p.search(name) for p in HARMLESS_LAYER_TENSORS)):
                raise InvalidCheckpointError(
                    f"{name} is in the weights but not read by the model config.json describes "
                    f"(num_hidden_layers={model.num_layers}); the config does not fit the weights")
    check_config_sizes(ckpt, config)
    return model
