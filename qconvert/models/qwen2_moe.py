"""Qwen2-MoE in JAX: the Qwen2 decoder with routed SwiGLU experts plus an always-on shared expert.

A sparse layer's feed-forward is

    moe(x) = sum over the top-k experts e of p_e * expert_e(x)
             + sigmoid(shared_expert_gate(x)) * shared_expert(x)

with p the router's softmax (`mlp.gate`), renormalized over the k kept only when
`norm_topk_prob`. Layers in `mlp_only_layers`, or off the `decoder_sparse_step`
beat, have a dense SwiGLU `mlp.{gate,up,down}_proj` instead. The experts run
through the grouped hook (moe.py); the router and the shared expert's gate are
ordinary linears that stay float (the family's FLOAT_LINEARS).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.models.activations import ACTIVATIONS
from qconvert.models.config_values import config_bool, config_int, config_layer_list
from qconvert.models.decoder_shapes import (Shapes, attention_shapes, embed_and_head_shapes,
                                            layer_norm_shapes, swiglu_shapes)
from qconvert.models.family import EXPERT, SmoothingGroup
from qconvert.models.hooks import GroupedLinearHook, LinearHook
from qconvert.models.llama import ATTENTION_LINEARS, LLAMA_REMEDY, LlamaModel, value_output_group
from qconvert.models.moe import routed_experts
from qconvert.models.qwen2 import qwen_args

SWIGLU = ("gate_proj", "up_proj", "down_proj")
ROUTER, SHARED_EXPERT_GATE = "mlp.gate", "mlp.shared_expert_gate"
ROUTED = tuple(f"mlp.experts.{EXPERT}.{proj}" for proj in SWIGLU)
SHARED = tuple(f"mlp.shared_expert.{proj}" for proj in SWIGLU)


@dataclasses.dataclass(frozen=True)
class QwenMoeArgs:
    """The config.json fields of the Qwen mixture-of-experts feed-forward."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]       # per layer: routed experts (True) or a dense MLP

    @classmethod
    def from_config(cls, config: dict[str, Any], shared_expert: bool) -> "QwenMoeArgs":
        """Read and check the MoE fields; InvalidCheckpointError names a key that does not fit."""
        layers = config_int(config, "num_hidden_layers")
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; released configs say num_experts.
        key = "num_experts" if "num_experts" in config or "num_local_experts" not in config else "num_local_experts"
        experts = config_int(config, key, minimum=0)
        top_k = config_int(config, "num_experts_per_tok")
        if experts and top_k > experts:
            raise InvalidCheckpointError(f"config.json: num_experts_per_tok ({top_k}) is more than num_experts "
                                         f"({experts}); restore the file from the model's source")
        step = config_int(config, "decoder_sparse_step", default=1)
        dense = set(config_layer_list(config, "mlp_only_layers", layers))
        return cls(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=config_int(config, "moe_intermediate_size"),
            shared_expert_intermediate_size=(config_int(config, "shared_expert_intermediate_size")
                                             if shared_expert else 0),
            norm_topk_prob=config_bool(config, "norm_topk_prob", False),  # transformers' default
            sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
        )


@dataclasses.dataclass(frozen=True)
class Qwen2MoeModel(LlamaModel):
    """Qwen2MoeForCausalLM as pure functions of `params` (see LlamaModel)."""

    family = "qwen2_moe"
    hf_architectures = ("Qwen2MoeForCausalLM",)
    # v_proj -> o_proj and up_proj -> down_proj (in every expert, the shared expert and dense MLPs).
    remedy = LLAMA_REMEDY
    # A sparse layer: attention, the router, every expert's gate/up/down_proj, the shared expert and its gate;
    # a dense one: attention and one SwiGLU. The router and the shared expert's gate stay float.
    LAYER_LINEARS = ATTENTION_LINEARS + (ROUTER,) + ROUTED + SHARED + (SHARED_EXPERT_GATE,)
    DENSE_LINEARS = ATTENTION_LINEARS + tuple(f"mlp.{proj}" for proj in SWIGLU)
    FLOAT_LINEARS = (ROUTER, SHARED_EXPERT_GATE)

    moe: QwenMoeArgs = QwenMoeArgs(1, 1, 1, 0, True, ())

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Qwen2MoeModel":
        args = dataclasses.replace(qwen_args(config), attention_bias=False,
                                   qkv_bias=config_bool(config, "qkv_bias", True))
        return cls(args, moe=QwenMoeArgs.from_config(config, shared_expert=True))

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    def layer_modules(self, i: int) -> tuple[str, ...]:
        """A sparse layer's LAYER_LINEARS, a dense one's DENSE_LINEARS."""
        return self.LAYER_LINEARS if self.moe.sparse_layers[i] else self.DENSE_LINEARS

    def _mlp_prefix(self, i: int) -> str:
        return f"{self.layer_prefix(i)}.mlp"

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""
        return super().layer_signature(i) + (self.moe.sparse_layers[i],)

    def router(self, i: int) -> str:
        """Layer i's router module (`mlp.gate`)."""
        return f"{self.layer_prefix(i)}.{ROUTER}"

    def expert_linears(self, i: int, proj: str) -> list[str]:
        """Module names of layer i's experts' `proj` (gate_proj, up_proj or down_proj), expert 0 first."""
        return [f"{self._mlp_prefix(i)}.experts.{e}.{proj}" for e in range(self.moe.num_experts)]

    def shared_expert_modules(self) -> tuple[str, ...]:
        """A sparse layer's shared expert gate/up/down_proj and its sigmoid gate, inside the layer
        (none without a shared expert)."""
        return SHARED + (SHARED_EXPERT_GATE,) if self.moe.shared_expert_intermediate_size else ()

    def shared_expert_linears(self, i: int) -> list[str]:
        """Layer i's shared expert gate/up/down_proj and its sigmoid gate (none without a shared expert)."""
        return [f"{self.layer_prefix(i)}.{m}" for m in self.shared_expert_modules()]

    def biased(self, proj: str) -> bool:
        if proj not in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return False
        return self.args.attention_bias or (self.args.qkv_bias and proj != "o_proj")

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q/k/v; post_attention_layernorm -> everything the feed-forward reads x with:
        the shared expert's gate/up_proj, every expert's gate/up_proj, and the router and shared-expert
        gate, which absorb s so the float model is unchanged but stay float (dense layers: gate/up_proj)."""
        attention = SmoothingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
        if not self.moe.sparse_layers[i]:
            return [attention, SmoothingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))]
        shared = self.shared_expert_modules()
        experts = tuple(f"mlp.experts.{e}.{proj}" for e in range(self.num_experts) for proj in SWIGLU[:2])
        # The shared expert (every token) first: --alpha auto searches on the first linear's input.
        return [attention, SmoothingGroup("post_attention_layernorm", (*shared[:2], *experts, ROUTER, *shared[3:]))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """up_proj -> down_proj in every expert and the shared expert (sparse layers), or the dense MLP."""
        if self.moe.sparse_layers[i]:
            owners = [f"mlp.experts.{e}" for e in range(self.num_experts)]
            owners += ["mlp.shared_expert"] if self.moe.shared_expert_intermediate_size else []
        else:
            owners = ["mlp"]
        return [SmoothingGroup(f"{o}.up_proj", (f"{o}.down_proj",)) for o in owners]

    def linear_smoothing_groups(self) -> list[SmoothingGroup]:
        """v_proj -> o_proj in every layer as in Llama, then the feed-forward's groups (the order
        qconvert.json records)."""
        return self.every_layer(lambda i: [value_output_group(self.args)]) + super().linear_smoothing_groups()

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """The routed experts plus the gated shared expert, or a dense SwiGLU."""
        if not self.moe.sparse_layers[i]:
            return super().mlp(i, params, x, attention_mask, linear, grouped_linear)
        act = ACTIVATIONS[self.args.hidden_act]
        # The router sees x as [B, T, hidden] like every other linear, so observers can
        # tell padding tokens by the attention mask.
        router_logits = linear(self.router(i), x, params[f"{self.router(i)}.weight"], None)
        out = routed_experts(x, router_logits, attention_mask, top_k=self.moe.num_experts_per_tok,
                             normalize=self.moe.norm_topk_prob,
                             expert_names=lambda proj: self.expert_linears(i, proj), projections=SWIGLU,
                             params=params, grouped_linear=grouped_linear, act=act)
        shared = self.shared_expert_linears(i)
        if shared:
            gate, up, down, shared_gate = shared

            def dense(module: str, inputs: jax.Array) -> jax.Array:
                return linear(module, inputs, params[f"{module}.weight"], None)

            shared_out = dense(down, act(dense(gate, x)) * dense(up, x))
            out = out + jax.nn.sigmoid(dense(shared_gate, x)) * shared_out
        return out

    def expected_shapes(self) -> Shapes:
        """Every tensor the forward reads, with the shape config.json implies."""
        a, m = self.args, self.moe
        shapes = embed_and_head_shapes(self)
        for i in range(self.num_layers):
            p = self._mlp_prefix(i)
            shapes.update(layer_norm_shapes(self, i))
            shapes.update(attention_shapes(self, i))
            if not m.sparse_layers[i]:
                shapes.update(swiglu_shapes(p, a.hidden_size, a.intermediate_size))
                continue
            shapes[f"{self.router(i)}.weight"] = (m.num_experts, a.hidden_size)
            for e in range(m.num_experts):
                shapes.update(swiglu_shapes(f"{p}.experts.{e}", a.hidden_size, m.moe_intermediate_size))
            if m.shared_expert_intermediate_size:
                shapes.update(swiglu_shapes(f"{p}.shared_expert", a.hidden_size, m.shared_expert_intermediate_size))
                shapes[f"{p}.shared_expert_gate.weight"] = (1, a.hidden_size)
        return shapes
