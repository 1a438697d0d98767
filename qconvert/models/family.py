"""What a model family tells the rest of qconvert: its names, linears, smoothing groups and forward.

Each family module (llama.py, bert.py, mixtral.py, ...) defines one `Architecture`
next to its forward; registry.py only collects them. The quantize pipeline and
verify ask the Architecture and know no model names themselves.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping

import jax

from qconvert.models.hooks import GroupedLinearHook, LinearHook, dense_grouped_linear, dense_linear


@dataclasses.dataclass(frozen=True)
class SmoothingGroup:
    """A source module (a norm or a linear) whose output is the input of `linears`.

    `source` is a module name whose `.weight` (and `.bias`, for LayerNorm or a
    biased linear) absorb 1/s; `linears` are module names whose weight columns absorb s.
    """

    source: str
    linears: tuple[str, ...]
    # When `source` is a linear (v_proj) whose output heads are each shared by
    # `kv_repeat` query heads (GQA), input channel i of `linears` comes from the
    # source's output channel ((i // head_dim) // kv_repeat) * head_dim + i % head_dim.
    kv_repeat: int = 1
    head_dim: int = 0
    # When `source` is a fused linear (Phi-3's qkv_proj, gate_up_proj), source channel c
    # above is its output row source_offset + c.
    source_offset: int = 0
    # The norm multiplies by (norm_offset + weight): 0 for Llama's RMSNorm and LayerNorm,
    # 1 for Gemma's, which stores its gain as an offset from 1. Smoothing divides the
    # gain, so it must fold into norm_offset + weight, not weight alone.
    norm_offset: float = 0.0


def _no_groups(config: dict[str, Any]) -> list[SmoothingGroup]:
    del config
    return []


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One model family as qconvert knows it.

    `model` is the family's forward (a class with `from_config(config)`); None for
    the weight-only fallback, which has no forward. `remedy` says, in the family's
    own module names, which inputs no norm feeds are smoothed linear -> linear
    (recorded in qconvert.json). `causal_lm`: the forward's head gives next-token logits.
    """

    family: str
    hf_architectures: tuple[str, ...]
    linear_pattern: re.Pattern  # matches a module name (without ".weight")
    smoothing_groups: Callable[[dict[str, Any]], list[SmoothingGroup]] = _no_groups
    default_alpha: float = 0.5
    # Linear -> linear groups for the inputs no norm feeds (o_proj, down_proj):
    # the source linear's rows (and bias) absorb 1/s, the consumers' columns s.
    linear_smoothing_groups: Callable[[dict[str, Any]], list[SmoothingGroup]] = _no_groups
    remedy: str = ""
    causal_lm: bool = True
    model: Any = None

    def is_linear(self, module_name: str) -> bool:
        return self.linear_pattern.search(module_name) is not None

    def linear_names(self, tensor_names) -> list[str]:
        """Module names (sorted) of the quantizable linears among a checkpoint's tensors."""
        modules = []
        for name in tensor_names:
            if name.endswith(".weight") and self.is_linear(name[: -len(".weight")]):
                modules.append(name[: -len(".weight")])
        return sorted(modules)

    def build(self, config: dict[str, Any]):
        """The family's forward-pass model for a parsed config.json."""
        if self.model is None:
            raise TypeError(f"the {self.family} family has no forward pass")
        return self.model.from_config(config)


# How every family's `remedy` starts; the rest names its own modules.
REMEDY_LEAD = "linear->linear smoothing of the inputs no norm feeds: "

EXPERT = "{expert}"  # in a per-layer module path: any expert number


def layer_linear_pattern(stack: str, modules: Iterable[str]) -> re.Pattern:
    """Match `<stack>.<N>.<module>` (after any prefix) for each per-layer module path in `modules`.

    The family's one list of per-layer linears gives both its forward's call order
    and this pattern, so the names are written once.
    """
    alternatives = "|".join(re.escape(m).replace(re.escape(EXPERT), r"\d+") for m in modules)
    return re.compile(rf"(^|\.){re.escape(stack)}\.\d+\.({alternatives})$")


class LayerStack:
    """What every family's forward shares: embed, the layers in order, then the head.

    A family's model supplies `args.num_hidden_layers`, `embed`, `layer(i, ...)` and `head`;
    runner.py calls the same three pieces one layer at a time.
    """

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    def forward(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                linear: LinearHook = dense_linear,
                grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array:
        """head(layers(embed(input_ids))) for input_ids [B, T] (positions 0..T-1, as transformers): logits
        float32 [B, T, vocab] for a causal LM, the last hidden state [B, T, hidden] for an encoder."""
        hidden = self.embed(params, input_ids, attention_mask)
        for i in range(self.num_layers):
            hidden = self.layer(i, params, hidden, attention_mask, linear, grouped_linear)
        return self.head(params, hidden, attention_mask, linear)
