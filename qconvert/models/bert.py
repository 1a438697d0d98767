"""BERT encoders in JAX (BertModel, as all-MiniLM-L6-v2): post-LN layers and mean pooling."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from qconvert.formats.errors import UnsupportedModelError
from qconvert.models.activations import ACTIVATIONS, check_activation
from qconvert.models.config_values import config_float, config_int, require_divides
from qconvert.models.family import REMEDY_LEAD, LayerStack, SmoothingGroup
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, as_float32,
                                   dense_grouped_linear, dense_linear)

# An encoder layer's linears, in the order the forward calls them.
LAYER_LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense", "intermediate.dense", "output.dense")


@dataclasses.dataclass(frozen=True)
class BertArgs:
    """The config.json fields a BertModel forward needs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # transformers' BertConfig defaults, for configs that leave them out.
    vocab_size: int = 30522
    max_position_embeddings: int = 512
    type_vocab_size: int = 2

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BertArgs":
        """Read a BertModel config.json (absolute position embeddings only)."""
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(
                f"BERT position_embedding_type {config['position_embedding_type']!r} is not "
                "supported; only 'absolute' is")
        check_activation(config.get("hidden_act", "gelu"), family="BERT")
        hidden, heads = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
        require_divides(config, "num_attention_heads", heads, "hidden_size", hidden)
        return cls(
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_hidden_layers=config_int(config, "num_hidden_layers"),
            num_attention_heads=heads,
            layer_norm_eps=config_float(config, "layer_norm_eps", 1e-12),
            hidden_act=config.get("hidden_act", "gelu"),
            vocab_size=config_int(config, "vocab_size", 30522),
            max_position_embeddings=config_int(config, "max_position_embeddings", 512),
            type_vocab_size=config_int(config, "type_vocab_size", 2),
        )


def layer_norm(x: jax.Array, weight: Any, bias: Any, eps: float) -> jax.Array:
    """(x - mean) / std * weight + bias, in float32."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * as_float32(weight) + as_float32(bias)


def mean_pool(hidden: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
    """Sentence embeddings [B, H]: the mean of the real tokens' hidden states (sentence-transformers)."""
    if attention_mask is None:
        return jnp.mean(hidden, axis=1)
    mask = jnp.asarray(attention_mask, jnp.float32)[..., None]
    return jnp.sum(hidden * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1e-9)


@dataclasses.dataclass(frozen=True)
class BertModel(LayerStack):
    """BertModel as pure functions of `params`; head() is the last hidden state (no pooler).

    No LayerNorm can absorb 1/s, so there are no norm groups: BERT is post-LN, every LayerNorm's
    output also feeds a residual (attention.output.LayerNorm's output h comes back in
    output.LayerNorm(FFN(h) + h); the previous layer's output.LayerNorm feeds q/k/v and
    attention.output.LayerNorm's residual).
    """

    family = "bert"
    hf_architectures = ("BertModel",)
    default_alpha = 0.5
    causal_lm = False
    remedy = (f"{REMEDY_LEAD}attention.self.value rows -> "
              "attention.output.dense columns (one scale per head channel); no LayerNorm group (post-LN: "
              "each LayerNorm also feeds a residual) and none into output.dense (GELU comes first)")
    LAYER_STACK = "encoder.layer"
    LAYER_LINEARS = LAYER_LINEARS

    args: BertArgs
    prefix: str = ""  # "bert." for a checkpoint that nests the encoder (config.json never says so)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BertModel":
        return cls(BertArgs.from_config(config))

    @property
    def layers_prefix(self) -> str:
        """What every encoder layer's tensor names start with (then the layer index)."""
        return f"{self.prefix}{self.LAYER_STACK}."

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""
        return ()

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads, with the shape config.json implies."""
        a = self.args
        h, inner = a.hidden_size, a.intermediate_size
        e = f"{self.prefix}embeddings"
        shapes: dict[str, tuple[int, ...]] = {
            f"{e}.word_embeddings.weight": (a.vocab_size, h),
            f"{e}.position_embeddings.weight": (a.max_position_embeddings, h),
            f"{e}.token_type_embeddings.weight": (a.type_vocab_size, h),
            f"{e}.LayerNorm.weight": (h,), f"{e}.LayerNorm.bias": (h,),
        }
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            linears = dict(zip(self.layer_linears(i), ((h, h), (h, h), (h, h), (h, h), (inner, h), (h, inner))))
            for module, (out, inp) in linears.items():
                shapes[f"{module}.weight"], shapes[f"{module}.bias"] = (out, inp), (out,)
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                shapes[f"{p}.{norm}.weight"] = shapes[f"{p}.{norm}.bias"] = (h,)
        return shapes

    def layer_tensor_names(self, i: int) -> list[str]:
        """Checkpoint tensor names layer i reads (every linear and LayerNorm has weight and bias)."""
        p = self.layer_prefix(i)
        modules = self.layer_linears(i) + [f"{p}.attention.output.LayerNorm", f"{p}.output.LayerNorm"]
        return [f"{m}.{part}" for m in modules for part in ("weight", "bias")]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """attention.self.value -> attention.output.dense (every head its own K/V).
        intermediate.dense -> output.dense is not smoothable: GELU sits between them."""
        return [SmoothingGroup("attention.self.value", ("attention.output.dense",), kv_repeat=1,
                               head_dim=self.args.hidden_size // self.args.num_attention_heads)]

    def embed_tensor_names(self) -> list[str]:
        """Tensor names the embedding reads."""
        e = f"{self.prefix}embeddings"
        return [f"{e}.word_embeddings.weight", f"{e}.position_embeddings.weight",
                f"{e}.token_type_embeddings.weight", f"{e}.LayerNorm.weight", f"{e}.LayerNorm.bias"]

    def head_tensor_names(self) -> list[str]:
        """The head reads nothing: BertModel's output is the last layer's hidden state."""
        return []

    def embed(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None,
              token_type_ids: jax.Array | None = None) -> jax.Array:
        """LayerNorm(word + position + token type embeddings), float32 [B, T, H]."""
        words, positions, types, ln_w, ln_b = (params[n] for n in self.embed_tensor_names())
        input_ids = jnp.asarray(input_ids)
        t = input_ids.shape[1]
        token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else jnp.asarray(token_type_ids)
        hidden = (jnp.take(as_float32(words), input_ids, axis=0)
                  + as_float32(positions)[:t][None]
                  + jnp.take(as_float32(types), token_type_ids, axis=0))
        return layer_norm(hidden, ln_w, ln_b, self.args.layer_norm_eps)

    def _linear(self, linear: LinearHook, params: Mapping, module: str, x: jax.Array) -> jax.Array:
        return linear(module, x, params[f"{module}.weight"], params[f"{module}.bias"])

    def attention(self, i: int, params: Mapping, hidden: jax.Array, attention_mask, linear: LinearHook):
        """Bidirectional self-attention over the real tokens (padding keys hidden)."""
        p, a = f"{self.layer_prefix(i)}.attention.self", self.args
        b, t, _ = hidden.shape
        head_dim = a.hidden_size // a.num_attention_heads

        def heads(module: str) -> jax.Array:
            y = self._linear(linear, params, f"{p}.{module}", hidden)
            return y.reshape(b, t, a.num_attention_heads, head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads("query"), heads("key"), heads("value")
        hi = jax.lax.Precision.HIGHEST
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=hi) * (head_dim ** -0.5)
        if attention_mask is not None:
            keep = (jnp.asarray(attention_mask) > 0)[:, None, None, :]
            scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v, precision=hi)
        return out.transpose(0, 2, 1, 3).reshape(b, t, a.hidden_size)

    def layer(self, i: int, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
              linear: LinearHook = dense_linear,
              grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array:
        """Encoder layer i (post-LN): h = LN(h + attn(h)); h = LN(h + ffn(h)). No experts here."""
        p, eps = self.layer_prefix(i), self.args.layer_norm_eps
        context = self.attention(i, params, hidden, attention_mask, linear)
        attn_out = self._linear(linear, params, f"{p}.attention.output.dense", context)
        hidden = layer_norm(hidden + attn_out, params[f"{p}.attention.output.LayerNorm.weight"],
                            params[f"{p}.attention.output.LayerNorm.bias"], eps)
        inner = ACTIVATIONS[self.args.hidden_act](
            self._linear(linear, params, f"{p}.intermediate.dense", hidden))
        ffn_out = self._linear(linear, params, f"{p}.output.dense", inner)
        return layer_norm(hidden + ffn_out, params[f"{p}.output.LayerNorm.weight"],
                          params[f"{p}.output.LayerNorm.bias"], eps)

    def head(self, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
             linear: LinearHook = dense_linear) -> jax.Array:
        """last_hidden_state: the last layer's output, unchanged."""
        return hidden

    def sentence_embeddings(self, params: Mapping, input_ids: jax.Array,
                            attention_mask: jax.Array | None = None,
                            linear: LinearHook = dense_linear) -> jax.Array:
        """Mean-pooled last hidden state [B, H] (all-MiniLM-L6-v2 then L2-normalizes; not done here)."""
        return mean_pool(self.forward(params, input_ids, attention_mask, linear), attention_mask)
