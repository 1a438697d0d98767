"""Phi-3 in JAX: the Llama decoder with fused projections and (optionally) partial rotary embeddings.

`self_attn.qkv_proj` is one linear whose output rows are the queries, then the
keys, then the values; `mlp.gate_up_proj` one linear whose first half of rows is
the gate and second half the up projection. Each is one linear with one input,
so input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj are
the norm groups; the linear groups start from slices of the fused outputs (the
value rows -> o_proj, the up rows -> down_proj).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from qconvert.models.activations import ACTIVATIONS
from qconvert.models.config_values import config_fraction
from qconvert.models.decoder_shapes import Shapes, embed_and_head_shapes, layer_norm_shapes
from qconvert.models.hooks import GroupedLinearHook, LinearHook
from qconvert.models.family import REMEDY_LEAD, SmoothingGroup
from qconvert.models.llama import LlamaArgs, LlamaModel

# A layer's linears, in the order the forward calls them.
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def partial_rotary_factor(config: dict[str, Any]) -> float:
    """The fraction of each head RoPE rotates (`rope_parameters` in transformers 5, else top level)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return config_fraction(params, "partial_rotary_factor", 1.0)
    return config_fraction(config, "partial_rotary_factor", 1.0)


@dataclasses.dataclass(frozen=True)
class Phi3Model(LlamaModel):
    """Phi3ForCausalLM as pure functions of `params` (see LlamaModel); no biases."""

    family = "phi3"
    hf_architectures = ("Phi3ForCausalLM",)
    remedy = (f"{REMEDY_LEAD}the value rows of qkv_proj -> o_proj columns (one scale per KV-head channel, "
              "shared by the query heads of its group), the up rows of gate_up_proj -> down_proj columns")
    LAYER_LINEARS = LAYER_LINEARS

    rotary_fraction: float = 1.0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Phi3Model":
        return cls(LlamaArgs.from_config(config), rotary_fraction=partial_rotary_factor(config))

    @property
    def rotary_dim(self) -> int:
        return int(self.args.head_dim * self.rotary_fraction)

    def biased(self, proj: str) -> bool:
        return False

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys and values cut from the rows of the fused qkv_proj."""
        a, (b, t, _) = self.args, x.shape
        qkv = self._linear(linear, params, f"{self.layer_prefix(i)}.self_attn.qkv_proj", x)
        q_end = a.num_attention_heads * a.head_dim
        k_end = q_end + a.num_key_value_heads * a.head_dim

        def heads(y: jax.Array) -> jax.Array:
            return y.reshape(b, t, -1, a.head_dim).transpose(0, 2, 1, 3)

        return heads(qkv[..., :q_end]), heads(qkv[..., q_end:k_end]), heads(qkv[..., k_end:])

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """down(act(gate) * up) with gate and up the two halves of gate_up_proj's output."""
        p = f"{self.layer_prefix(i)}.mlp"
        gate, up = jnp.split(self._linear(linear, params, f"{p}.gate_up_proj", x), 2, axis=-1)
        return self._linear(linear, params, f"{p}.down_proj", ACTIVATIONS[self.args.hidden_act](gate) * up)

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj."""
        return [SmoothingGroup("input_layernorm", ("self_attn.qkv_proj",)),
                SmoothingGroup("post_attention_layernorm", ("mlp.gate_up_proj",))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """The value rows of qkv_proj -> o_proj (GQA as in Llama) and the up rows of gate_up_proj ->
        down_proj: the smoothing divides only those rows of the fused linear."""
        a = self.args
        return [SmoothingGroup("self_attn.qkv_proj", ("self_attn.o_proj",),
                               kv_repeat=a.num_attention_heads // a.num_key_value_heads, head_dim=a.head_dim,
                               source_offset=(a.num_attention_heads + a.num_key_value_heads) * a.head_dim),
                SmoothingGroup("mlp.gate_up_proj", ("mlp.down_proj",), source_offset=a.intermediate_size)]

    def expected_shapes(self) -> Shapes:
        """Every tensor the forward reads, with the shape config.json implies."""
        a = self.args
        shapes = embed_and_head_shapes(self)
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            shapes.update(layer_norm_shapes(self, i))
            shapes[f"{p}.self_attn.qkv_proj.weight"] = (
                (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim, a.hidden_size)
            shapes[f"{p}.self_attn.o_proj.weight"] = (a.hidden_size, a.num_attention_heads * a.head_dim)
            shapes[f"{p}.mlp.gate_up_proj.weight"] = (2 * a.intermediate_size, a.hidden_size)
            shapes[f"{p}.mlp.down_proj.weight"] = (a.hidden_size, a.intermediate_size)
        return shapes
