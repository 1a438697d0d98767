"""Qwen3-MoE in JAX: Qwen3's attention (per-head q/k norms) with Qwen2-MoE's routed experts, no shared expert.

Unlike Qwen2-MoE, `sliding_window` (with `use_sliding_window`) applies to every
layer. The released configs set `norm_topk_prob` (renormalize the top-k weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from qconvert.models.config_values import config_bool
from qconvert.models.decoder_shapes import Shapes
from qconvert.models.llama import ATTENTION_LINEARS, LlamaArgs
from qconvert.models.qwen2_moe import ROUTED, ROUTER, QwenMoeArgs, Qwen2MoeModel
from qconvert.models.qwen3 import QkNormAttention, check_head_dim, qk_norm_names


def qwen3_moe_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """The attention window of every layer: `sliding_window` everywhere when `use_sliding_window`."""
    window = config.get("sliding_window") if config_bool(config, "use_sliding_window", False) else None
    return tuple(int(window) if window else None for _ in range(layers))


@dataclasses.dataclass(frozen=True)
class Qwen3MoeModel(QkNormAttention, Qwen2MoeModel):
    """Qwen3MoeForCausalLM as pure functions of `params` (see LlamaModel)."""

    family = "qwen3_moe"
    hf_architectures = ("Qwen3MoeForCausalLM",)
    LAYER_LINEARS = ATTENTION_LINEARS + (ROUTER,) + ROUTED  # no shared expert
    FLOAT_LINEARS = (ROUTER,)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Qwen3MoeModel":
        check_head_dim(config)
        args = LlamaArgs.from_config(config)
        args = dataclasses.replace(args, qkv_bias=False,
                                   sliding_windows=qwen3_moe_windows(config, args.num_hidden_layers))
        return cls(args, moe=QwenMoeArgs.from_config(config, shared_expert=False))

    def expected_shapes(self) -> Shapes:
        """Qwen2-MoE's shapes (no shared expert) plus the [head_dim] q_norm and k_norm weights."""
        shapes = super().expected_shapes()
        for i in range(self.num_layers):
            shapes.update({name: (self.args.head_dim,) for name in qk_norm_names(self, i)})
        return shapes
