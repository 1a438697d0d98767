"""Qwen3 in JAX: the Llama decoder with an RMSNorm over each query and key head (q_norm, k_norm) before RoPE.

Only q and k are normed: v_proj's output reaches o_proj through attention alone,
so v_proj -> o_proj smooths exactly as in Llama; the per-head norms come after
q_proj and k_proj, so the input_layernorm -> q/k/v group is Llama's too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from qconvert.models.config_values import config_int
from qconvert.models.decoder_shapes import (Shapes, attention_shapes, embed_and_head_shapes,
                                            layer_norm_shapes, swiglu_shapes)
from qconvert.models.hooks import LinearHook
from qconvert.models.llama import LlamaModel, rms_norm
from qconvert.models.qwen2 import qwen_args


def qk_norm_names(model: LlamaModel, i: int) -> list[str]:
    """Layer i's per-head query and key norm weights."""
    p = f"{model.layer_prefix(i)}.self_attn"
    return [f"{p}.q_norm.weight", f"{p}.k_norm.weight"]


def qk_normed(model: LlamaModel, i: int, params: Mapping, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [B, H, T, d] and k [B, KV, T, d], each head RMS-normed over d with its [d] weight."""
    q_norm, k_norm = qk_norm_names(model, i)
    eps = model.args.rms_norm_eps
    return rms_norm(q, params[q_norm], eps), rms_norm(k, params[k_norm], eps)


class QkNormAttention:
    """Mixin for a Llama-family model whose attention RMS-norms each query and key head (q_norm, k_norm)."""

    def layer_tensor_names(self, i: int) -> list[str]:
        """The base family's layer tensors plus the q_norm and k_norm weights."""
        return super().layer_tensor_names(i) + qk_norm_names(self, i)

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The base family's projections, then q_norm and k_norm per head."""
        q, k, v = super().qkv_heads(i, params, x, linear)
        q, k = qk_normed(self, i, params, q, k)
        return q, k, v


def check_head_dim(config: dict[str, Any]) -> None:
    """head_dim, when given, must be a positive integer (Qwen3 sets it apart from hidden/heads)."""
    config_int(config, "head_dim", default=None)


@dataclasses.dataclass(frozen=True)
class Qwen3Model(QkNormAttention, LlamaModel):
    """Qwen3ForCausalLM as pure functions of `params` (see LlamaModel): Llama's linears, smoothing groups
    and remedy, Qwen's sliding windows, no biases."""

    family = "qwen3"
    hf_architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Qwen3Model":
        check_head_dim(config)
        return cls(qwen_args(config))

    def expected_shapes(self) -> Shapes:
        """Every tensor the forward reads, with the shape config.json implies."""
        a = self.args
        shapes = embed_and_head_shapes(self)
        for i in range(self.num_layers):
            shapes.update(layer_norm_shapes(self, i))
            shapes.update(attention_shapes(self, i))
            shapes.update({name: (a.head_dim,) for name in qk_norm_names(self, i)})
            shapes.update(swiglu_shapes(f"{self.layer_prefix(i)}.mlp", a.hidden_size, a.intermediate_size))
        return shapes
