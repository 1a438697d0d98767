"""What a model family is to the rest of qconvert: one class, whose attributes the registry and the plan
read and whose instances (built once from config.json) run the forward and name the smoothing groups.

Each family module (llama.py, bert.py, mixtral.py, ...) defines its model class on `LayerStack`;
registry.py only lists the classes. The quantize pipeline and verify ask the family and know no model
names themselves. `Family` below writes down what they ask; `DecoderHooks` what a subclass of a family
overrides to change one part of the layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, Iterable, Mapping, Protocol, runtime_checkable

import jax

from qconvert.models.hooks import GroupedLinearHook, LinearHook, dense_grouped_linear, dense_linear


@dataclasses.dataclass(frozen=True)
class SmoothingGroup:
    """A source module (a norm or a linear) whose output is the input of `linears`.

    `source` is a module name whose `.weight` (and `.bias`, for LayerNorm or a
    biased linear) absorb 1/s; `linears` are module names whose weight columns absorb s.
    A family declares its groups per layer in module paths inside the layer
    (`input_layernorm`, `self_attn.q_proj`); `under(prefix)` names them in the checkpoint.
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
    # When the source's heads lie `source_stride` channels apart rather than head_dim (DeepSeek's kv_b_proj:
    # each head's key rows, then its value rows), the channel above is ((i // head_dim) // kv_repeat) *
    # source_stride + i % head_dim; the source channels no input channel reads (the key rows) keep scale 1.
    source_stride: int = 0
    # The norm multiplies by (norm_offset + weight): 0 for Llama's RMSNorm and LayerNorm,
    # 1 for Gemma's, which stores its gain as an offset from 1. Smoothing divides the
    # gain, so it must fold into norm_offset + weight, not weight alone.
    norm_offset: float = 0.0

    def under(self, prefix: str) -> "SmoothingGroup":
        """The group with every module path put under `prefix` (a layer's, e.g. "model.layers.3")."""
        return dataclasses.replace(self, source=f"{prefix}.{self.source}",
                                   linears=tuple(f"{prefix}.{m}" for m in self.linears))


# How every family's `remedy` starts; the rest names its own modules.
REMEDY_LEAD = "linear->linear smoothing of the inputs no norm feeds: "

EXPERT = "{expert}"  # in a per-layer module path: each expert's number


def layer_linear_pattern(stack: str, modules: Iterable[str]) -> re.Pattern:
    """Match `<stack>.<N>.<module>` (after any prefix) for each per-layer module path in `modules`."""
    alternatives = "|".join(re.escape(m).replace(re.escape(EXPERT), r"[0-9]+") for m in modules)
    return re.compile(rf"(^|\.){re.escape(stack)}\.[0-9]+\.({alternatives})$")


class FamilyFacts(Protocol):
    """What the registry, the plan and the records read of a family before (or without) a model.

    A family class has these as class attributes; the `--any-architecture` fallback
    (weight_only.py) is an object with the same ones and no forward.
    """

    family: ClassVar[str]                   # the family's own name ("llama", "bert", ...)
    hf_architectures: ClassVar[tuple[str, ...]]  # the config.json "architectures" names it serves
    default_alpha: ClassVar[float]          # SmoothQuant's alpha when --alpha names none
    causal_lm: ClassVar[bool]               # the head gives next-token logits
    # Which inputs no norm feeds are smoothed linear -> linear, in the family's module names
    # (recorded in qconvert.json).
    remedy: ClassVar[str]
    # Regular expressions (matched from the start, as compressed-tensors reads `re:` entries) of whole
    # sub-models the family keeps float, whatever --include says: a multimodal checkpoint's vision tower
    # and projector. The loaders' ignore list names each with one `re:` entry.
    float_towers: ClassVar[tuple[str, ...]]

    def linear_names(self, tensor_names: Iterable[str]) -> list[str]:
        """Module names (sorted) of the quantizable linears among a checkpoint's tensor names."""


@runtime_checkable
class Family(FamilyFacts, Protocol):
    """A model family with a forward: what the pipeline, the runner, calibration and verify call.

    Built once per command by `from_checkpoint(config, tensor_names)` (InvalidCheckpointError, exit 6,
    naming the key of a bad config.json). `params` is any Mapping from checkpoint tensor name to
    array (lazy readers and QArray weights included); every linear runs through the `linear`
    hook and experts through `grouped_linear` (hooks.py).
    """

    LAYER_STACK: ClassVar[str]              # the numbered stack's name ("layers", "encoder.layer")
    LAYER_LINEARS: ClassVar[tuple[str, ...]]  # a layer's linears inside it, in call order
    FLOAT_LINEARS: ClassVar[tuple[str, ...]]  # those among them that stay float (routers)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Family": ...

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any], tensor_names: Iterable[str]) -> "Family":
        """The model for config.json and the checkpoint's tensor names (a family whose tensors are named by
        who saved the checkpoint picks the names here; the others are `from_config`)."""

    @classmethod
    def language_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """config.json's values for the language model (a multimodal checkpoint's text_config, its defaults
        filled in; config.json itself elsewhere)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def layers_prefix(self) -> str:
        """What every layer's tensor names start with, then the index ("model.layers.")."""

    def layer_prefix(self, i: int) -> str:
        """Layer i's module prefix ("model.layers.3")."""

    def embed_tensor_names(self) -> list[str]: ...
    def layer_tensor_names(self, i: int) -> list[str]: ...
    def head_tensor_names(self) -> list[str]: ...

    def layer_linears(self, i: int) -> list[str]:
        """Module names of layer i's linears, in the order the forward calls them."""

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads -> the shape config.json implies (a tied lm_head omitted)."""

    def smoothing_groups(self) -> list[SmoothingGroup]:
        """SmoothQuant's norm -> linears groups of every layer."""

    def linear_smoothing_groups(self) -> list[SmoothingGroup]:
        """The linear -> linear groups (the remedy) of every layer."""

    def embed(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None
              ) -> jax.Array: ...

    def layer(self, i: int, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
              linear: LinearHook = dense_linear,
              grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array: ...

    def head(self, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
             linear: LinearHook = dense_linear) -> jax.Array:
        """Logits float32 [B, T, vocab] for a causal LM, the last hidden state for an encoder."""


@runtime_checkable
class DecoderHooks(Protocol):
    """What a subclass of a decoder family (LlamaModel, GemmaModel) overrides to change one part of a layer.

    The layer calls these; everything else (norms, the projections around attention, residuals) it keeps.
    """

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer i's queries [B, H, T, d], keys and values [B, KV, T, d] before RoPE (fused: Phi-3;
        normed per head: Qwen3)."""

    def attend(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array,
               attention_mask: jax.Array | None) -> jax.Array:
        """RoPE and attention of layer i's heads, [B, H, T, d] out (Gemma: its own RoPE per layer, query
        scale and logit cap)."""

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask: jax.Array | None,
            linear: LinearHook, grouped_linear: GroupedLinearHook) -> jax.Array:
        """Layer i's feed-forward on the normed hidden states (experts: Mixtral, the Qwen MoEs)."""

    def biased(self, proj: str) -> bool:
        """Whether the linear `proj` (its module name's last part: q_proj, down_proj, ...) has a bias."""

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """Layer i's norm -> linears groups, in module paths inside the layer."""

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """Layer i's linear -> linear groups, in module paths inside the layer."""


class LayerStack:
    """What every family class shares: the facts' defaults, its linears from `LAYER_LINEARS`,
    the smoothing groups from the per-layer declarations, and the forward (embed, layers, head).

    A family supplies `args.num_hidden_layers`, `layers_prefix`, `embed`, `layer(i, ...)` and
    `head`; calibration/layers.py calls the same three pieces one layer at a time.
    """

    family: ClassVar[str]
    hf_architectures: ClassVar[tuple[str, ...]]
    default_alpha: ClassVar[float] = 0.5
    causal_lm: ClassVar[bool] = True
    remedy: ClassVar[str] = ""
    float_towers: ClassVar[tuple[str, ...]] = ()
    LAYER_STACK: ClassVar[str] = "layers"
    LAYER_LINEARS: ClassVar[tuple[str, ...]] = ()
    # The linears of a layer without experts, in a family whose layers differ (Qwen-MoE's dense layers).
    DENSE_LINEARS: ClassVar[tuple[str, ...]] = ()
    FLOAT_LINEARS: ClassVar[tuple[str, ...]] = ()
    linear_pattern: ClassVar[re.Pattern]  # matches a quantized linear's module name (without ".weight")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        quantized = [m for m in dict.fromkeys(cls.LAYER_LINEARS + cls.DENSE_LINEARS) if m not in cls.FLOAT_LINEARS]
        cls.linear_pattern = layer_linear_pattern(cls.LAYER_STACK, quantized)

    @classmethod
    def linear_names(cls, tensor_names: Iterable[str]) -> list[str]:
        """Module names (sorted) of the quantizable linears among a checkpoint's tensor names."""
        modules = [name[: -len(".weight")] for name in tensor_names if name.endswith(".weight")]
        return sorted(m for m in modules if cls.linear_pattern.search(m))

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any], tensor_names: Iterable[str]) -> "LayerStack":
        """The model for config.json; its tensor names follow from config.json alone here."""
        return cls.from_config(config)

    @classmethod
    def language_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """config.json's values for the language model: config.json itself."""
        return config

    @property
    def num_layers(self) -> int:
        return self.args.num_hidden_layers

    @property
    def num_experts(self) -> int:
        """How many experts a layer's `{expert}` linears stand for (0 without experts)."""
        return 0

    def layer_prefix(self, i: int) -> str:
        """Layer i's module prefix ("model.layers.3")."""
        return f"{self.layers_prefix}{i}"

    def layer_modules(self, i: int) -> tuple[str, ...]:
        """Layer i's linears inside it (`{expert}` standing for each expert), in call order."""
        return self.LAYER_LINEARS

    def layer_linears(self, i: int) -> list[str]:
        """Module names of layer i's linears, in the order the forward calls them."""
        p = self.layer_prefix(i)
        return [f"{p}.{m.format(expert=e)}" for m in self.layer_modules(i)
                for e in (range(self.num_experts) if EXPERT in m else (None,))]

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        return []

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        return []

    def every_layer(self, groups_of) -> list[SmoothingGroup]:
        """`groups_of(i)` for each layer i, named under the layer's prefix, layer 0 first."""
        return [g.under(self.layer_prefix(i)) for i in range(self.num_layers) for g in groups_of(i)]

    def smoothing_groups(self) -> list[SmoothingGroup]:
        """SmoothQuant's norm -> linears groups of every layer."""
        return self.every_layer(self.layer_norm_groups)

    def linear_smoothing_groups(self) -> list[SmoothingGroup]:
        """The linear -> linear groups (the inputs no norm feeds: the remedy) of every layer."""
        return self.every_layer(self.layer_linear_groups)

    def forward(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                linear: LinearHook = dense_linear,
                grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array:
        """head(layers(embed(input_ids))) for input_ids [B, T] (positions 0..T-1, as transformers): logits
        float32 [B, T, vocab] for a causal LM, the last hidden state [B, T, hidden] for an encoder."""
        hidden = self.embed(params, input_ids, attention_mask)
        for i in range(self.num_layers):
            hidden = self.layer(i, params, hidden, attention_mask, linear, grouped_linear)
        return self.head(params, hidden, attention_mask, linear)
