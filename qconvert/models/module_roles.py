"""What a module is to the loaders beyond being a 2-D weight: a router, an expert, a GPT-2-style Conv1D,
or the output head, read from its name, its shape and config.json alone (no torch, no forward).

The loaders quantize by module type (compressed-tensors: every `Linear`; transformers' bitsandbytes:
every `nn.Linear` and `Conv1D`), not by what qconvert chose, so a folder is right only when the modules
qconvert keeps float are the ones the loader leaves alone. These rules say which ones those are:

- routers pick the experts. transformers builds them as its own router modules (OLMoE's, DeepSeek-V3's,
  GPT-OSS's `*TopKRouter`), not as linears, so a quantized router is not read back and stays at random
  initialisation; vLLM keeps them unquantized too. They are never quantized.
- experts (`...experts.N...`): transformers 5.x fuses them into one 3-D parameter per projection, and its
  bitsandbytes 4-bit path leaves that parameter float.
- a `Conv1D` (GPT-2, GPT-1, ImageGPT, Decision Transformer, CLVP: `c_attn`, `c_proj`, `c_fc`, `q_attn`)
  stores its weight [in, out], transposed against a linear's [out, in]; compressed-tensors does not
  replace it (it is no `Linear`), so it stays float.
- the output head, when tied to the input embeddings, is not stored but is built by the loader as a
  linear; most families call it `lm_head`, a few others not (BioGPT's `output_projection`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# config.json keys that give the number of routed experts, in the families' own spellings.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts")
# The last name components routers and expert gates have (Mixtral/Qwen-MoE/OLMoE/DeepSeek `gate`,
# GPT-OSS `router`, GraniteMoE `router.layer`, Qwen2-MoE's one-output `shared_expert_gate`).
ROUTER_NAMES = ("gate", "router", "shared_expert_gate", "gating", "moe_gate")
CONV1D_NAMES = ("c_attn", "c_proj", "c_fc", "q_attn")
_EXPERT = re.compile(r"(?:^|\.)experts\.[0-9]+\.")
# The module a tied output head is loaded as, where it is not `lm_head` (transformers' model classes).
HEAD_NAMES = {"biogpt": "output_projection", "gpt_neox_japanese": "embed_out", "git": "output", "rwkv": "head",
              "modernbert-decoder": "decoder"}
DEFAULT_HEAD = "lm_head"


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def expert_count(config: Mapping[str, Any]) -> int | None:
    """The number of routed experts config.json gives (also under text_config), or None for a dense model."""
    for source in (config, _text_config(config)):
        for key in EXPERT_COUNT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                return value
    return None


def is_router(module: str, out_features: int | None, experts: int | None) -> bool:
    """Whether `module` routes tokens to experts: named as a router or gate (not a `gate_proj`), a module
    inside a router, or, in a model with experts, a linear whose output width is the number of experts."""
    parts = module.split(".")
    if parts[-1] in ROUTER_NAMES or "router" in parts[:-1]:
        return True
    return experts is not None and out_features == experts


def is_expert(module: str) -> bool:
    """Whether `module` is one expert's projection (`...experts.N.<proj>`), which transformers fuses."""
    return _EXPERT.search(module) is not None


def is_conv1d(module: str) -> bool:
    """Whether `module` is a GPT-2-style Conv1D, whose weight is stored [in, out]."""
    return module.rsplit(".", 1)[-1] in CONV1D_NAMES


def head_name(config: Mapping[str, Any]) -> str:
    """The module name loaders give the output head (the one a tied head is rebuilt as)."""
    return HEAD_NAMES.get(str(_text_config(config).get("model_type", config.get("model_type"))), DEFAULT_HEAD)
