"""Qwen2 in JAX: the Llama decoder with biases on q, k and v, and the Qwen families' sliding-window layout.

Qwen configs carry `sliding_window` whether or not it is used: `use_sliding_window`
turns it on (off when absent), and then only for the layers `layer_types` marks
sliding, or else those at or past `max_window_layers`. Qwen3 and Qwen2-MoE keep the
same rule (qwen3.py, qwen2_moe.py); Qwen3-MoE has its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qconvert.models.llama import LlamaArgs, LlamaModel


def qwen_sliding_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window (None = full causal attention) under the Qwen rule above."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    types = config.get("layer_types") or [
        "sliding_attention" if i >= int(config.get("max_window_layers", layers)) else "full_attention"
        for i in range(layers)]
    return tuple(int(window) if window and t == "sliding_attention" else None for t in types)


def qwen_args(config: dict[str, Any]) -> LlamaArgs:
    """A Qwen config.json's LlamaArgs: Llama's fields with the Qwen sliding-window layout."""
    args = LlamaArgs.from_config(config)
    return dataclasses.replace(args, sliding_windows=qwen_sliding_windows(config, args.num_hidden_layers))


@dataclasses.dataclass(frozen=True)
class Qwen2Model(LlamaModel):
    """Qwen2ForCausalLM as pure functions of `params` (see LlamaModel)."""

    family = "qwen2"
    hf_architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Qwen2Model":
        return cls(dataclasses.replace(qwen_args(config), qkv_bias=True))
