"""The architecture registry: decides from config.json alone whether a model is supported.

Each family says which of its tensors are linear layers (the ones a scheme
quantizes) and which norm feeds which linears (the SmoothQuant groups). The
quantize pipeline asks the architecture; it knows no model names itself.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from qconvert.errors import InvalidCheckpointError, UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class SmoothingGroup:
    """A norm (or linear) whose output is the input of `linears`.

    `norm` is a module name whose `.weight` (and `.bias`, for LayerNorm) absorb
    1/s; `linears` are module names whose weight columns absorb s.
    """

    norm: str
    linears: tuple[str, ...]
    # When `norm` is a linear (v_proj) whose output heads are each shared by
    # `kv_repeat` query heads (GQA), input channel i of `linears` comes from the
    # source's output channel ((i // head_dim) // kv_repeat) * head_dim + i % head_dim.
    kv_repeat: int = 1
    head_dim: int = 0
    # When `norm` is a fused linear (Phi-3's qkv_proj, gate_up_proj), source channel c
    # above is its output row source_offset + c.
    source_offset: int = 0
    # The norm multiplies by (norm_offset + weight): 0 for Llama's RMSNorm and LayerNorm,
    # 1 for Gemma's, which stores its gain as an offset from 1. Smoothing divides the
    # gain, so it must fold into norm_offset + weight, not weight alone.
    norm_offset: float = 0.0


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family as qconvert knows it."""

    family: str
    hf_architectures: tuple[str, ...]
    linear_pattern: re.Pattern  # matches a module name (without ".weight")
    smoothing_groups: Callable[[dict[str, Any]], list[SmoothingGroup]]
    default_alpha: float = 0.5
    # Linear -> linear groups for the inputs no norm feeds (o_proj, down_proj):
    # the source linear's rows (and bias) absorb 1/s, the consumers' columns s.
    linear_smoothing_groups: Callable[[dict[str, Any]], list[SmoothingGroup]] = lambda config: []

    def is_linear(self, module_name: str) -> bool:
        return self.linear_pattern.search(module_name) is not None

    def linear_names(self, tensor_names) -> list[str]:
        """Module names (sorted) of the quantizable linears among a checkpoint's tensors."""
        modules = []
        for name in tensor_names:
            if name.endswith(".weight") and self.is_linear(name[: -len(".weight")]):
                modules.append(name[: -len(".weight")])
        return sorted(modules)


def _llama_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    groups = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        groups.append(SmoothingGroup(f"{p}.input_layernorm",
                                     tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")))
        groups.append(SmoothingGroup(f"{p}.post_attention_layernorm",
                                     (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj")))
    return groups


def _llama_linear_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    # v -> o: attention is linear in V per head, so scaling v_proj's output row c
    # by 1/s scales every o_proj input channel that reads kv channel c by 1/s.
    # up -> down: down_proj's input is act(gate) * up, linear in up.
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    groups = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        groups.append(SmoothingGroup(f"{p}.self_attn.v_proj", (f"{p}.self_attn.o_proj",),
                                     kv_repeat=heads // kv_heads, head_dim=head_dim))
        groups.append(SmoothingGroup(f"{p}.mlp.up_proj", (f"{p}.mlp.down_proj",)))
    return groups


def _bert_prefix(config: dict[str, Any]) -> str:
    return config.get("_qconvert_prefix", "")


def _bert_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    # Post-LN: every LayerNorm's output also feeds a residual (attention.output.LayerNorm's
    # output h comes back in output.LayerNorm(FFN(h) + h); the previous layer's
    # output.LayerNorm feeds q/k/v and attention.output.LayerNorm's residual), so
    # no LayerNorm can absorb 1/s without changing the model. BERT smooths only
    # value -> attention.output.dense (see _bert_linear_groups).
    del config
    return []


def _bert_linear_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    # value -> attention.output.dense (every head its own K/V). intermediate ->
    # output.dense is not smoothable: GELU sits between them.
    p = _bert_prefix(config)
    heads = int(config["num_attention_heads"])
    return [
        SmoothingGroup(f"{p}encoder.layer.{i}.attention.self.value",
                       (f"{p}encoder.layer.{i}.attention.output.dense",),
                       kv_repeat=1, head_dim=int(config["hidden_size"]) // heads)
        for i in range(int(config["num_hidden_layers"]))
    ]


LLAMA = Architecture(
    family="llama",
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    linear_pattern=re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$"),
    smoothing_groups=_llama_groups,
    default_alpha=0.85,
    linear_smoothing_groups=_llama_linear_groups,
)

BERT = Architecture(
    family="bert",
    hf_architectures=("BertModel",),
    linear_pattern=re.compile(
        r"(^|\.)encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
        r"|intermediate\.dense|output\.dense)$"
    ),
    smoothing_groups=_bert_groups,
    default_alpha=0.5,
    linear_smoothing_groups=_bert_linear_groups,
)

def _mixtral_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    # post_attention_layernorm feeds the router and every expert's w1 and w3. The
    # router (gate) is listed so its columns absorb s too and the float model stays
    # unchanged; it is not a quantized linear (see MIXTRAL's pattern), so it stays float.
    groups = []
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}"
        experts = [f"{p}.block_sparse_moe.experts.{e}"
                   for e in range(int(config["num_local_experts"]))]
        groups.append(SmoothingGroup(f"{p}.input_layernorm",
                                     tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")))
        groups.append(SmoothingGroup(
            f"{p}.post_attention_layernorm",
            tuple(f"{e}.{w}" for e in experts for w in ("w1", "w3")) + (f"{p}.block_sparse_moe.gate",)))
    return groups


def _mixtral_linear_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    # v -> o as in Llama; each expert's w3 (up) -> w2 (down), since w2's input is act(w1 x) * w3 x.
    groups = [g for g in _llama_linear_groups(config) if g.norm.endswith("v_proj")]
    for i in range(int(config["num_hidden_layers"])):
        for e in range(int(config["num_local_experts"])):
            q = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            groups.append(SmoothingGroup(f"{q}.w3", (f"{q}.w2",)))
    return groups


MIXTRAL = Architecture(
    family="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    # The router (block_sparse_moe.gate) is deliberately not matched: it stays float.
    linear_pattern=re.compile(
        r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])$"),
    smoothing_groups=_mixtral_groups,
    default_alpha=0.85,
    linear_smoothing_groups=_mixtral_linear_groups,
)

ARCHITECTURES: list[Architecture] = [LLAMA, BERT, MIXTRAL]


def supported_architectures() -> list[str]:
    return sorted(a for arch in ARCHITECTURES for a in arch.hf_architectures)


def register(arch: Architecture) -> None:
    """Add a family (the MoE and later families register themselves here)."""
    ARCHITECTURES.append(arch)


def architecture_for(config: dict[str, Any]) -> Architecture:
    """The Architecture for a parsed config.json, or UnsupportedModelError naming what is supported."""
    names = config.get("architectures") or []
    if isinstance(names, str) or (isinstance(names, list) and names and not isinstance(names[0], str)):
        raise InvalidCheckpointError(
            f"config.json: \"architectures\" is {names!r}; it must be a list of names, "
            f"e.g. [\"{names if isinstance(names, str) else 'LlamaForCausalLM'}\"]")
    if not isinstance(names, list) or not names:
        raise UnsupportedModelError(
            "config.json names no architecture (\"architectures\" is missing); supported: "
            + ", ".join(supported_architectures())
        )
    for arch in ARCHITECTURES:
        if names[0] in arch.hf_architectures:
            return arch
    raise UnsupportedModelError(
        f"unsupported architecture {names[0]}; supported: " + ", ".join(supported_architectures())
    )
