"""The Llama family in JAX (Llama, Mistral): GQA, RoPE, RMSNorm, SwiGLU, sliding windows."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from qconvert.models.activations import ACTIVATIONS, check_activation
from qconvert.models.config_values import config_bool, config_float, config_int, require_divides
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, as_float32, cached_kv,
                                   dense_grouped_linear, dense_linear)
from qconvert.models.family import REMEDY_LEAD, LayerStack, SmoothingGroup
from qconvert.models.rope import RopeConfig, apply_rope, rope_angles

# A decoder layer's linears, in the order the forward calls them.
ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LAYER_LINEARS = ATTENTION_LINEARS + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclasses.dataclass(frozen=True)
class DecoderArgs:
    """The config.json sizes every decoder forward needs; each family's args add their own fields after them."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float


@dataclasses.dataclass(frozen=True)
class LlamaArgs(DecoderArgs):
    """The config.json fields a Llama-family forward needs."""

    rope: RopeConfig
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # bias on q, k, v and o (Llama's flag)
    qkv_bias: bool = False         # bias on q, k, v only (Qwen2 sets it)
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full causal attention

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LlamaArgs":
        """Read a Llama-style config.json (LlamaForCausalLM, MistralForCausalLM and the families built on them)."""
        hidden = config_int(config, "hidden_size")
        heads = config_int(config, "num_attention_heads")
        layers = config_int(config, "num_hidden_layers")
        kv_heads = config_int(config, "num_key_value_heads", None) if config.get("num_key_value_heads") else heads
        require_divides(config, "num_key_value_heads", kv_heads, "num_attention_heads", heads)
        if config.get("head_dim"):
            head_dim = config_int(config, "head_dim")
        else:
            require_divides(config, "num_attention_heads", heads, "hidden_size", hidden)
            head_dim = hidden // heads
        check_activation(config.get("hidden_act", "silu"))
        return cls(
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=config_int(config, "vocab_size"),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            rope=RopeConfig.from_config(config),
            hidden_act=config.get("hidden_act", "silu"),
            tie_word_embeddings=config_bool(config, "tie_word_embeddings", False),
            attention_bias=config_bool(config, "attention_bias", False),
            mlp_bias=config_bool(config, "mlp_bias", False),
            sliding_windows=sliding_windows(config, layers),
        )


def sliding_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window: Mistral and Mixtral use `sliding_window` in every layer; Llama none.
    (The Qwen families have their own rule: qwen2.py.)"""
    window = None if config.get("model_type") == "llama" else config.get("sliding_window")
    return tuple(int(window) if window else None for _ in range(layers))


def rms_norm(x: jax.Array, weight: Any, eps: float) -> jax.Array:
    """x / rms(x) * weight, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * as_float32(weight)


def gated_mlp(project: Callable[[str, jax.Array], jax.Array], p: str, x: jax.Array,
              activation: str) -> jax.Array:
    """down(act(gate(x)) * up(x)) of the feed-forward at prefix p; project(module, x) runs one linear."""
    gate = project(f"{p}.gate_proj", x)
    up = project(f"{p}.up_proj", x)
    return project(f"{p}.down_proj", ACTIVATIONS[activation](gate) * up)


def attention_bias(seq_len: int, attention_mask: jax.Array | None, window: int | None) -> jax.Array:
    """Additive mask [B or 1, 1, T, T]: causal, padding keys hidden, keys older than `window` hidden.

    A finite large negative (not -inf) keeps rows with no visible key (left padding) finite.
    """
    q = jnp.arange(seq_len)[:, None]
    k = jnp.arange(seq_len)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & (jnp.asarray(attention_mask) > 0)[:, None, None, :]
    return jnp.where(allowed, 0.0, jnp.finfo(jnp.float32).min)


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
                            scale: float | None = None) -> jax.Array:
    """softmax(q k^T * scale + bias) v with q [B, H, T, d], k [B, KV, T, d] and v [B, KV, T, dv] shared by H/KV
    heads; scale 1/sqrt(d) unless given."""
    repeats = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, repeats, axis=1)
    v = jnp.repeat(v, repeats, axis=1)
    hi = jax.lax.Precision.HIGHEST
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=hi) * scale + bias
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v, precision=hi)


def value_output_group(args: DecoderArgs) -> SmoothingGroup:
    """v_proj -> o_proj inside a layer: attention is linear in V per head, so scaling v_proj's
    output row c by 1/s scales every o_proj input channel that reads kv channel c by 1/s."""
    return SmoothingGroup("self_attn.v_proj", ("self_attn.o_proj",),
                          kv_repeat=args.num_attention_heads // args.num_key_value_heads, head_dim=args.head_dim)


# down_proj's input is act(gate) * up, linear in up.
UP_DOWN_GROUP = SmoothingGroup("mlp.up_proj", ("mlp.down_proj",))

VALUE_OUTPUT_REMEDY = ("v_proj rows -> o_proj columns "
                       "(one scale per KV-head channel, shared by the query heads of its group)")
LLAMA_REMEDY = f"{REMEDY_LEAD}{VALUE_OUTPUT_REMEDY}, up_proj rows -> down_proj columns"


class DecoderBlock:
    """What the decoder families (Llama's, Gemma's) share: the layer stack under `prefix`, and the attention
    block: q/k/v projected into heads (`qkv_heads`), `attend` (RoPE and the attention itself, the family's
    own), the heads merged and projected by o_proj."""

    @property
    def layers_prefix(self) -> str:
        """What every decoder layer's tensor names start with (then the layer index)."""
        return f"{self.prefix}.{self.LAYER_STACK}."

    # Why a server's per-tensor KV-cache scales do not apply to this family's cache (None: they do).
    kv_cache_refusal: str | None = None
    ACTIVATION_FIELD = "hidden_act"  # the config field (an args field) naming the gated MLP's activation

    @property
    def activation(self) -> str:
        """The gated MLP's activation (config.json's `ACTIVATION_FIELD`)."""
        return getattr(self.args, self.ACTIVATION_FIELD)

    def kv_cache_blocks(self) -> list[str]:
        """The attention modules whose keys and values `attend` hands to models.hooks.cached_kv, by layer."""
        return [f"{self.layer_prefix(i)}.self_attn" for i in range(self.num_layers)]

    def linear_tensor_names(self, i: int) -> list[str]:
        """Layer i's linears' weights, each followed by its bias where the linear has one."""
        names = []
        for module in self.layer_linears(i):
            names.append(f"{module}.weight")
            if self.biased(module.rsplit(".", 1)[1]):
                names.append(f"{module}.bias")
        return names

    def roped_and_cached(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, rope: RopeConfig,
                         rotary_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer i's queries and keys with RoPE, and its keys and values as its KV cache holds them."""
        cos, sin = rope_angles(rope, rotary_dim, q.shape[2])
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = cached_kv(f"{self.layer_prefix(i)}.self_attn", k, v)
        return q, k, v

    def _linear(self, linear: LinearHook, params: Mapping, module: str, x: jax.Array) -> jax.Array:
        bias = params[f"{module}.bias"] if self.biased(module.rsplit(".", 1)[1]) else None
        return linear(module, x, params[f"{module}.weight"], bias)

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer i's queries [B, H, T, d], keys and values [B, KV, T, d] before RoPE."""
        a, p = self.args, f"{self.layer_prefix(i)}.self_attn"
        b, t, _ = x.shape

        def heads(module: str, n: int) -> jax.Array:
            y = self._linear(linear, params, f"{p}.{module}", x)
            return y.reshape(b, t, n, a.head_dim).transpose(0, 2, 1, 3)

        return (heads("q_proj", a.num_attention_heads), heads("k_proj", a.num_key_value_heads),
                heads("v_proj", a.num_key_value_heads))

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """Gated feed-forward: down(act(gate(x)) * up(x)), act the family's `activation`."""
        project = functools.partial(self._linear, linear, params)
        return gated_mlp(project, f"{self.layer_prefix(i)}.mlp", x, self.activation)

    def attention(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook) -> jax.Array:
        """Self-attention of layer i on the normed hidden states x [B, T, hidden]."""
        q, k, v = self.qkv_heads(i, params, x, linear)
        out = self.attend(i, q, k, v, attention_mask)
        b, heads, t, head_dim = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, t, heads * head_dim)
        return self._linear(linear, params, f"{self.layer_prefix(i)}.self_attn.o_proj", out)


@dataclasses.dataclass(frozen=True)
class LlamaModel(DecoderBlock, LayerStack):
    """LlamaForCausalLM and MistralForCausalLM as pure functions of `params`.

    `params` maps checkpoint tensor names to arrays (lazily read ones too; linear
    weights may be QArrays). Hidden states are float32 [B, T, hidden_size].
    """

    family = "llama"
    hf_architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    default_alpha = 0.85
    remedy = LLAMA_REMEDY
    LAYER_LINEARS = LAYER_LINEARS

    args: LlamaArgs
    prefix: str = "model"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LlamaModel":
        return cls(LlamaArgs.from_config(config))

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""
        return (self.args.sliding_windows[i],)

    def linear_shapes(self, i: int) -> dict[str, tuple[int, int]]:
        """[out, in] of layer i's linears as config.json implies them."""
        a = self.args
        q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        shapes = ((q, a.hidden_size), (kv, a.hidden_size), (kv, a.hidden_size), (a.hidden_size, q),
                  (a.intermediate_size, a.hidden_size), (a.intermediate_size, a.hidden_size),
                  (a.hidden_size, a.intermediate_size))
        p = self.layer_prefix(i)
        return dict(zip((f"{p}.{m}" for m in LAYER_LINEARS), shapes, strict=True))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward reads, with the shape config.json implies (lm_head omitted when tied)."""
        a = self.args
        shapes: dict[str, tuple[int, ...]] = {f"{self.prefix}.embed_tokens.weight": (a.vocab_size, a.hidden_size)}
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            shapes[f"{p}.input_layernorm.weight"] = (a.hidden_size,)
            shapes[f"{p}.post_attention_layernorm.weight"] = (a.hidden_size,)
            for module, (out, inp) in self.linear_shapes(i).items():
                shapes[f"{module}.weight"] = (out, inp)
                if self.biased(module.rsplit(".", 1)[1]):
                    shapes[f"{module}.bias"] = (out,)
        shapes[f"{self.prefix}.norm.weight"] = (a.hidden_size,)
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, a.hidden_size)
        return shapes

    def biased(self, proj: str) -> bool:
        """Whether the linear `proj` (q_proj, ..., down_proj) has a bias."""
        if proj in ("gate_proj", "up_proj", "down_proj"):
            return self.args.mlp_bias
        return self.args.attention_bias or (self.args.qkv_bias and proj != "o_proj")

    def layer_tensor_names(self, i: int) -> list[str]:
        """Checkpoint tensor names layer i reads (norm weights, linear weights and biases)."""
        p = self.layer_prefix(i)
        return [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight", *self.linear_tensor_names(i)]

    def embed_tensor_names(self) -> list[str]:
        """Tensor names the embedding reads."""
        return [f"{self.prefix}.embed_tokens.weight"]

    def embed(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Token embeddings, float32 [B, T, hidden]."""
        table = as_float32(params[f"{self.prefix}.embed_tokens.weight"])
        return jnp.take(table, jnp.asarray(input_ids), axis=0)

    @property
    def rotary_dim(self) -> int:
        """How many leading channels of each head RoPE rotates (all of them here)."""
        return self.args.head_dim

    def attend(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, attention_mask) -> jax.Array:
        """RoPE on layer i's heads, then grouped-query attention (a sliding window where the layer has one)."""
        q, k, v = self.roped_and_cached(i, q, k, v, self.args.rope, self.rotary_dim)
        return grouped_query_attention(q, k, v, attention_bias(q.shape[2], attention_mask,
                                                               self.args.sliding_windows[i]))

    def layer(self, i: int, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
              linear: LinearHook = dense_linear,
              grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array:
        """Decoder layer i (pre-norm): h += attn(norm(h)); h += mlp(norm(h))."""
        p, eps = self.layer_prefix(i), self.args.rms_norm_eps
        x = rms_norm(hidden, params[f"{p}.input_layernorm.weight"], eps)
        hidden = hidden + self.attention(i, params, x, attention_mask, linear)
        x = rms_norm(hidden, params[f"{p}.post_attention_layernorm.weight"], eps)
        return hidden + self.mlp(i, params, x, attention_mask, linear, grouped_linear)

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q/k/v and post_attention_layernorm -> gate/up."""
        return [SmoothingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                SmoothingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """v_proj -> o_proj, then up_proj -> down_proj."""
        return [value_output_group(self.args), UP_DOWN_GROUP]

    def head_tensor_names(self) -> list[str]:
        """Tensor names the head reads: the final norm and lm_head (the embedding when tied)."""
        lm_head = (f"{self.prefix}.embed_tokens.weight" if self.args.tie_word_embeddings
                   else "lm_head.weight")
        return [f"{self.prefix}.norm.weight", lm_head]

    def head(self, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
             linear: LinearHook = dense_linear) -> jax.Array:
        """Final RMSNorm and lm_head: logits float32 [B, T, vocab]."""
        x = rms_norm(hidden, params[f"{self.prefix}.norm.weight"], self.args.rms_norm_eps)
        lm_head_name = self.head_tensor_names()[1]
        return linear("lm_head", x, params[lm_head_name], None)


