"""Qwen2-MoE in JAX: the Qwen2 decoder with routed SwiGLU experts plus an always-on shared expert.

A sparse layer's feed-forward is

    moe(x) = sum over the top-k experts e of p_e * expert_e(x)
             + sigmoid(shared_expert_gate(x)) * shared_expert(x)

with p the router's softmax (`mlp.gate`), renormalized over the k kept only when
`norm_topk_prob`. Layers in `mlp_only_layers`, or off the `decoder_sparse_step`
beat, have a dense SwiGLU `mlp.{gate,up,down}_proj` instead. The experts run
through the grouped hook (moe.py); the router and the shared expert's gate are
ordinary linears that stay float (they are not in the family's linear pattern).
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
from qconvert.models.family import EXPERT, Architecture, SmoothingGroup, layer_linear_pattern
from qconvert.models.hooks import GroupedLinearHook, LinearHook
from qconvert.models.llama import ATTENTION_LINEARS, LLAMA_REMEDY, LlamaArgs, LlamaModel, value_output_groups
from qconvert.models.moe import routed_experts

SWIGLU = ("gate_proj", "up_proj", "down_proj")


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

    moe: QwenMoeArgs = QwenMoeArgs(1, 1, 1, 0, True, ())

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Qwen2MoeModel":
        args = dataclasses.replace(LlamaArgs.from_config(config), attention_bias=False,
                                   qkv_bias=config_bool(config, "qkv_bias", True))
        return cls(args, moe=QwenMoeArgs.from_config(config, shared_expert=True))

    def _mlp_prefix(self, i: int) -> str:
        return f"{self._layer_prefix(i)}.mlp"

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""
        return super().layer_signature(i) + (self.moe.sparse_layers[i],)

    def router(self, i: int) -> str:
        """Layer i's router module (`mlp.gate`)."""
        return f"{self._mlp_prefix(i)}.gate"

    def expert_linears(self, i: int, proj: str) -> list[str]:
        """Module names of layer i's experts' `proj` (gate_proj, up_proj or down_proj), expert 0 first."""
        return [f"{self._mlp_prefix(i)}.experts.{e}.{proj}" for e in range(self.moe.num_experts)]

    def shared_expert_linears(self, i: int) -> list[str]:
        """Layer i's shared expert gate/up/down_proj and its sigmoid gate (none without a shared expert)."""
        if not self.moe.shared_expert_intermediate_size:
            return []
        p = self._mlp_prefix(i)
        return [f"{p}.shared_expert.{proj}" for proj in SWIGLU] + [f"{p}.shared_expert_gate"]

    def layer_linears(self, i: int) -> list[str]:
        """Attention, then the router, every expert's gate/up/down_proj and the shared expert (sparse
        layers) or the dense gate/up/down_proj."""
        attention = [f"{self._layer_prefix(i)}.{module}" for module in ATTENTION_LINEARS]
        if not self.moe.sparse_layers[i]:
            return attention + [f"{self._mlp_prefix(i)}.{proj}" for proj in SWIGLU]
        experts = [m for proj in SWIGLU for m in self.expert_linears(i, proj)]
        return attention + [self.router(i)] + experts + self.shared_expert_linears(i)

    def _biased(self, proj: str) -> bool:
        if proj not in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return False
        return self.args.attention_bias or (self.args.qkv_bias and proj != "o_proj")

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


def moe_smoothing_groups(model: Qwen2MoeModel) -> list[SmoothingGroup]:
    """input_layernorm -> q/k/v; post_attention_layernorm -> everything the feed-forward reads x with:
    the shared expert's gate/up_proj, every expert's gate/up_proj, and the router and shared-expert
    gate, which absorb s so the float model is unchanged but stay float (dense layers: gate/up_proj)."""
    groups = []
    for i in range(model.num_layers):
        p, mlp = model._layer_prefix(i), model._mlp_prefix(i)
        groups.append(SmoothingGroup(f"{p}.input_layernorm", tuple(f"{p}.self_attn.{x}_proj" for x in "qkv")))
        if model.moe.sparse_layers[i]:
            shared = model.shared_expert_linears(i)
            experts = [f"{e}.{proj}" for e in (f"{mlp}.experts.{n}" for n in range(model.moe.num_experts))
                       for proj in SWIGLU[:2]]
            # The shared expert (every token) first: --alpha auto searches on the first linear's input.
            linears = shared[:2] + experts + [model.router(i)] + shared[3:]
        else:
            linears = [f"{mlp}.gate_proj", f"{mlp}.up_proj"]
        groups.append(SmoothingGroup(f"{p}.post_attention_layernorm", tuple(linears)))
    return groups


def moe_linear_smoothing_groups(model: Qwen2MoeModel, config: dict[str, Any]) -> list[SmoothingGroup]:
    """v_proj -> o_proj as in Llama; up_proj -> down_proj in every expert, the shared expert and dense MLPs."""
    groups = value_output_groups(config)
    for i in range(model.num_layers):
        mlp = model._mlp_prefix(i)
        if model.moe.sparse_layers[i]:
            owners = [f"{mlp}.experts.{e}" for e in range(model.moe.num_experts)]
            owners += [f"{mlp}.shared_expert"] if model.moe.shared_expert_intermediate_size else []
        else:
            owners = [mlp]
        groups.extend(SmoothingGroup(f"{o}.up_proj", (f"{o}.down_proj",)) for o in owners)
    return groups


# Routers (mlp.gate) and shared-expert gates are deliberately not matched: they stay float.
QWEN_MOE_LINEARS = layer_linear_pattern("layers", ATTENTION_LINEARS + tuple(
    f"mlp.{owner}{proj}" for owner in ("", f"experts.{EXPERT}.", "shared_expert.") for proj in SWIGLU))


def qwen_moe_architecture(family: str, hf_architecture: str, model: type[Qwen2MoeModel]) -> Architecture:
    """A Qwen-MoE family's Architecture: its linears and smoothing groups come from `model`."""
    return Architecture(
        family=family,
        hf_architectures=(hf_architecture,),
        linear_pattern=QWEN_MOE_LINEARS,
        smoothing_groups=lambda config: moe_smoothing_groups(model.from_config(config)),
        default_alpha=0.85,
        linear_smoothing_groups=lambda config: moe_linear_smoothing_groups(model.from_config(config), config),
        # v_proj -> o_proj and up_proj -> down_proj (in every expert, the shared expert and dense MLPs).
        remedy=LLAMA_REMEDY,
        causal_lm=True,
        model=model,
    )


QWEN2_MOE = qwen_moe_architecture("qwen2_moe", "Qwen2MoeForCausalLM", Qwen2MoeModel)
