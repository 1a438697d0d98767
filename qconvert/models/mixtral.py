"""Mixtral in JAX: the Llama/Mistral decoder with a top-k routed mixture of SwiGLU experts.

The experts run through the grouped hook (see hooks.py):

    grouped_linear(names, x, weights, group_sizes) -> y

called three times per layer, once for all experts' w1 (gate), w3 (up) and w2
(down): `names` are the E module names "<layer>.block_sparse_moe.experts.{e}.w1"
(.w3, .w2), x holds one row per (token, chosen expert) pair sorted by expert,
`weights` the E checkpoint weights [out, in] (arrays or QArrays), group_sizes the
rows per expert. Padding tokens are routed to no expert: their rows sit past
sum(group_sizes) and come out zero, so they neither cost compute nor show up in
calibration statistics. The float default runs XLA's jax.lax.ragged_dot; verify
swaps in the grouped kernels for quantized experts.

The router (`block_sparse_moe.gate`) is an ordinary linear: it goes through the
`linear` hook but is one of the family's FLOAT_LINEARS, so it stays float.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.models.activations import ACTIVATIONS
from qconvert.models.config_values import config_int
from qconvert.models.family import EXPERT, REMEDY_LEAD, SmoothingGroup
from qconvert.models.hooks import GroupedLinearHook, LinearHook
from qconvert.models.llama import (ATTENTION_LINEARS, VALUE_OUTPUT_REMEDY, LlamaArgs, LlamaModel,
                                   value_output_group)
from qconvert.models.moe import routed_experts

EXPERT_PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
MOE = "block_sparse_moe"
ROUTER = f"{MOE}.gate"


@dataclasses.dataclass(frozen=True)
class MixtralArgs:
    """The config.json fields of the mixture-of-experts feed-forward."""

    num_local_experts: int
    num_experts_per_tok: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MixtralArgs":
        experts, per_token = config_int(config, "num_local_experts"), config_int(config, "num_experts_per_tok")
        if per_token > experts:
            raise InvalidCheckpointError(f"config.json: num_experts_per_tok = {per_token} exceeds "
                                         f"num_local_experts = {experts}; the config is inconsistent")
        return cls(experts, per_token)


@dataclasses.dataclass(frozen=True)
class MixtralModel(LlamaModel):
    """MixtralForCausalLM: LlamaModel's attention, norms and head; a sparse MoE feed-forward."""

    family = "mixtral"
    hf_architectures = ("MixtralForCausalLM",)
    remedy = f"{REMEDY_LEAD}{VALUE_OUTPUT_REMEDY}, each expert's w3 rows -> w2 columns"
    # Attention, the router, then every expert's w1, w3, w2; the router stays float.
    LAYER_LINEARS = ATTENTION_LINEARS + (ROUTER,) + tuple(f"{MOE}.experts.{EXPERT}.{w}" for w in EXPERT_PROJECTIONS)
    FLOAT_LINEARS = (ROUTER,)

    moe: MixtralArgs = MixtralArgs(1, 1)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MixtralModel":
        return cls(LlamaArgs.from_config(config), moe=MixtralArgs.from_config(config))

    @property
    def num_experts(self) -> int:
        return self.moe.num_local_experts

    def _moe_prefix(self, i: int) -> str:
        return f"{self.layer_prefix(i)}.{MOE}"

    def expert_linears(self, i: int, proj: str) -> list[str]:
        """Module names of layer i's experts' `proj` ("w1", "w2" or "w3"), expert 0 first."""
        return [f"{self._moe_prefix(i)}.experts.{e}.{proj}" for e in range(self.moe.num_local_experts)]

    def biased(self, proj: str) -> bool:
        return proj in ("q_proj", "k_proj", "v_proj", "o_proj") and self.args.attention_bias

    def linear_shapes(self, i: int) -> dict[str, tuple[int, int]]:
        """[out, in] of layer i's attention linears, router and experts as config.json implies them."""
        a = self.args
        shapes = {m: s for m, s in super().linear_shapes(i).items() if ".self_attn." in m}
        shapes[f"{self.layer_prefix(i)}.{ROUTER}"] = (self.moe.num_local_experts, a.hidden_size)
        for proj, shape in (("w1", (a.intermediate_size, a.hidden_size)),
                            ("w3", (a.intermediate_size, a.hidden_size)),
                            ("w2", (a.hidden_size, a.intermediate_size))):
            shapes.update({m: shape for m in self.expert_linears(i, proj)})
        return shapes

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q/k/v; post_attention_layernorm -> every expert's w1 and w3 and the router.

        The router is listed so its columns absorb s too and the float model stays
        unchanged; it is one of FLOAT_LINEARS, so it stays float.
        """
        experts = [f"{MOE}.experts.{e}.{w}" for e in range(self.num_experts) for w in ("w1", "w3")]
        return [SmoothingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                SmoothingGroup("post_attention_layernorm", (*experts, ROUTER))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """Each expert's w3 (up) -> w2 (down), since w2's input is act(w1 x) * w3 x."""
        return [SmoothingGroup(f"{MOE}.experts.{e}.w3", (f"{MOE}.experts.{e}.w2",)) for e in range(self.num_experts)]

    def linear_smoothing_groups(self) -> list[SmoothingGroup]:
        """v_proj -> o_proj in every layer, then the experts' groups (the order qconvert.json records)."""
        return self.every_layer(lambda i: [value_output_group(self.args)]) + super().linear_smoothing_groups()

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """Sparse MoE: each token's top-k experts' SwiGLU outputs, weighted by the router."""
        router = f"{self.layer_prefix(i)}.{ROUTER}"
        # The router sees x as [B, T, hidden] like every other linear, so observers can
        # tell padding tokens by the attention mask.
        router_logits = linear(router, x, params[f"{router}.weight"], None)
        return routed_experts(x, router_logits, attention_mask, top_k=self.moe.num_experts_per_tok,
                              normalize=True, expert_names=lambda proj: self.expert_linears(i, proj),
                              projections=EXPERT_PROJECTIONS, params=params, grouped_linear=grouped_linear,
                              act=ACTIVATIONS[self.args.hidden_act])
