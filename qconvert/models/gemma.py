"""Gemma 2 and Gemma 3 (text) in JAX: RMSNorm as x * (1 + w), scaled embeddings, gelu-tanh MLP,
sandwich norms around attention and MLP, sliding and global layers, soft-capping (Gemma 2), q/k norms
and a local RoPE base (Gemma 3)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.formats import QArray
from qconvert.formats.qarray import is_prepared
from qconvert.models.hooks import (GroupedLinearHook, LinearHook, as_float32, dense_grouped_linear,
                                   dense_linear)
from qconvert.models.activations import check_activation
from qconvert.models.config_values import config_float, config_int
from qconvert.models.family import LayerStack, SmoothingGroup
from qconvert.models.llama import (LAYER_LINEARS, LLAMA_REMEDY, UP_DOWN_GROUP, DecoderArgs, DecoderBlock,
                                   attention_bias, rms_norm, value_output_group)
from qconvert.models.rope import RopeConfig

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 2 alternates sliding and global layers; Gemma 3 has five sliding layers per global one.
_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's attention: `layer_types`, else the family's pattern (layer i is global when
    (i + 1) is a multiple of `sliding_window_pattern`)."""
    types = config.get("layer_types")
    if types is None:
        pattern = config_int(config, "sliding_window_pattern", _SLIDING_PATTERN.get(config.get("model_type"), 2))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise InvalidCheckpointError(
            f"config.json: layer_types must list {layers} entries (num_hidden_layers), each "
            f"{SLIDING!r} or {FULL!r}")
    return tuple(types)


def layer_ropes(config: dict[str, Any], types: tuple[str, ...]) -> tuple[RopeConfig, ...]:
    """RoPE per layer. Gemma 3 keeps one RoPE per layer type: `rope_parameters` keyed by type
    (transformers 5), or `rope_theta` + `rope_scaling` for global layers and `rope_local_base_freq`
    (unscaled) for sliding ones (earlier configs). Gemma 2 has one RoPE for every layer."""
    base = {"max_position_embeddings": config.get("max_position_embeddings", 8192)}
    params = config.get("rope_parameters") or {}
    if config.get("model_type") != "gemma3_text":
        single = RopeConfig.from_config(config)
        return tuple(single for _ in types)
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        by_type = {t: RopeConfig.from_config({**base, "rope_parameters": params.get(t) or {}})
                   for t in (SLIDING, FULL)}
    else:
        full = {**base, "rope_theta": config.get("rope_theta", 1_000_000.0),
                "rope_scaling": config.get("rope_scaling")}
        local = {**base, "rope_local_base_freq": config.get("rope_local_base_freq", 10_000.0)}
        by_type = {FULL: RopeConfig.from_config(full),
                   SLIDING: RopeConfig.from_config(local, theta_key="rope_local_base_freq")}
    return tuple(by_type[t] for t in types)


@dataclasses.dataclass(frozen=True)
class GemmaArgs(DecoderArgs):
    """The config.json fields a Gemma 2 / Gemma 3 text forward needs."""

    query_pre_attn_scalar: float
    layer_types: tuple[str, ...]
    ropes: tuple[RopeConfig, ...]
    sliding_window: int | None
    hidden_activation: str = "gelu_pytorch_tanh"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm: bool = False           # Gemma 3: RMSNorm per head on q and k
    attention_bias: bool = False
    tie_word_embeddings: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GemmaArgs":
        """Read a Gemma2ForCausalLM / Gemma3ForCausalLM config.json (InvalidCheckpointError naming a bad key)."""
        layers = config_int(config, "num_hidden_layers")
        heads = config_int(config, "num_attention_heads")
        kv_heads = config_int(config, "num_key_value_heads", heads)
        if heads % kv_heads:
            raise InvalidCheckpointError(f"config.json: num_key_value_heads ({kv_heads}) must divide "
                                         f"num_attention_heads ({heads})")
        hidden = config_int(config, "hidden_size")
        activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        check_activation(activation, key="hidden_activation")
        gemma3 = config.get("model_type") == "gemma3_text"
        types = layer_types(config, layers)
        window = config.get("sliding_window")
        return cls(
            hidden_size=hidden,
            intermediate_size=config_int(config, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=config_int(config, "head_dim", hidden // heads),
            vocab_size=config_int(config, "vocab_size"),
            rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
            query_pre_attn_scalar=config_float(config, "query_pre_attn_scalar", 256),
            layer_types=types,
            ropes=layer_ropes(config, types),
            sliding_window=None if window is None else config_int(config, "sliding_window"),
            hidden_activation=activation,
            # Gemma 3 configs carry attn_logit_softcapping, but its attention does not apply it.
            attn_logit_softcapping=None if gemma3 else config_float(config, "attn_logit_softcapping", None),
            final_logit_softcapping=config_float(config, "final_logit_softcapping", None),
            qk_norm=gemma3,
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


def gemma_rms_norm(x: jax.Array, weight: Any, eps: float) -> jax.Array:
    """x / rms(x) * (1 + weight), in float32 (Gemma stores the norm's gain as an offset from 1)."""
    return rms_norm(x, 1.0 + as_float32(weight), eps)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap): bounds x to (-cap, cap); identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def gemma_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, scale: float,
                    softcap: float | None) -> jax.Array:
    """softmax(softcap(q k^T * scale) + bias) v; q [B, H, T, d], k and v [B, KV, T, d] shared by H/KV heads."""
    repeats = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, repeats, axis=1)
    v = jnp.repeat(v, repeats, axis=1)
    hi = jax.lax.Precision.HIGHEST
    scores = soft_cap(jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=hi) * scale, softcap) + bias
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v, precision=hi)


@dataclasses.dataclass(frozen=True)
class GemmaModel(DecoderBlock, LayerStack):
    """Gemma2ForCausalLM and Gemma3ForCausalLM as pure functions of `params` (see LlamaModel)."""

    family = "gemma"
    hf_architectures = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    default_alpha = 0.85  # as for the Llama family: both are pre-norm decoders with gated MLPs
    remedy = LLAMA_REMEDY
    LAYER_LINEARS = LAYER_LINEARS  # Llama's seven linears per layer
    ACTIVATION_FIELD = "hidden_activation"  # gelu-tanh

    args: GemmaArgs
    prefix: str = "model"
    lm_head: str = "lm_head"  # the untied head's module name

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GemmaModel":
        return cls(GemmaArgs.from_config(config))

    def layer_signature(self, i: int) -> tuple:
        """What besides the weights sets layer i's program (layers with equal signatures share one)."""
        return (self.args.layer_types[i], self.args.ropes[i])

    def _norms(self, i: int) -> list[str]:
        p = self.layer_prefix(i)
        norms = [f"{p}.{n}" for n in ("input_layernorm", "post_attention_layernorm",
                                      "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        if self.args.qk_norm:
            norms += [f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
        return norms

    def biased(self, proj: str) -> bool:
        """Whether the linear `proj` (q_proj, ..., down_proj) has a bias: the attention's, with attention_bias."""
        return self.args.attention_bias and proj in ("q_proj", "k_proj", "v_proj", "o_proj")

    def layer_tensor_names(self, i: int) -> list[str]:
        """Checkpoint tensor names layer i reads (norm weights, linear weights and biases)."""
        return [f"{n}.weight" for n in self._norms(i)] + self.linear_tensor_names(i)

    def embed_tensor_names(self) -> list[str]:
        return [f"{self.prefix}.embed_tokens.weight"]

    def head_tensor_names(self) -> list[str]:
        """The final norm and lm_head (the embedding when tied)."""
        lm_head = (f"{self.prefix}.embed_tokens.weight" if self.args.tie_word_embeddings
                   else f"{self.lm_head}.weight")
        return [f"{self.prefix}.norm.weight", lm_head]

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name the forward reads, with the shape config.json implies."""
        a = self.args
        q_out, kv_out = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        shapes: dict[str, tuple[int, ...]] = {f"{self.prefix}.embed_tokens.weight": (a.vocab_size, a.hidden_size),
                                              f"{self.prefix}.norm.weight": (a.hidden_size,)}
        if not a.tie_word_embeddings:
            shapes[f"{self.lm_head}.weight"] = (a.vocab_size, a.hidden_size)
        out_in = {"q_proj": (q_out, a.hidden_size), "k_proj": (kv_out, a.hidden_size),
                  "v_proj": (kv_out, a.hidden_size), "o_proj": (a.hidden_size, q_out),
                  "gate_proj": (a.intermediate_size, a.hidden_size),
                  "up_proj": (a.intermediate_size, a.hidden_size),
                  "down_proj": (a.hidden_size, a.intermediate_size)}
        for i in range(a.num_hidden_layers):
            for norm in self._norms(i):
                dim = a.head_dim if norm.endswith(("q_norm", "k_norm")) else a.hidden_size
                shapes[f"{norm}.weight"] = (dim,)
            for module in self.layer_linears(i):
                shape = out_in[module.rsplit(".", 1)[1]]
                shapes[f"{module}.weight"] = shape
                if self.biased(module.rsplit(".", 1)[1]):
                    shapes[f"{module}.bias"] = (shape[0],)
        return shapes

    def embed(self, params: Mapping, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Token embeddings times sqrt(hidden_size), float32 [B, T, hidden].

        As transformers does, the scale is rounded to the table's dtype and the product
        computed in it (a bf16 table gives sqrt(2304) = 48.0, not 48.0000...).
        """
        table = params[f"{self.prefix}.embed_tokens.weight"]
        if isinstance(table, QArray) or is_prepared(table):  # rows are looked up in the decoded table
            table = as_float32(table)
        table = jnp.asarray(table)
        rows = jnp.take(table, jnp.asarray(input_ids), axis=0)
        scale = jnp.asarray(np.sqrt(np.float32(self.args.hidden_size)), dtype=table.dtype)
        return (rows * scale).astype(jnp.float32)

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Layer i's queries [B, H, T, d], keys and values [B, KV, T, d] before RoPE (Gemma 3: each query
        and key head RMS-normed)."""
        q, k, v = super().qkv_heads(i, params, x, linear)
        a, p = self.args, f"{self.layer_prefix(i)}.self_attn"
        if a.qk_norm:
            q = gemma_rms_norm(q, params[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = gemma_rms_norm(k, params[f"{p}.k_norm.weight"], a.rms_norm_eps)
        return q, k, v

    def attend(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, attention_mask) -> jax.Array:
        """RoPE (the layer's own: local or global), then attention with Gemma's query scale and logit cap."""
        a, t = self.args, q.shape[2]
        q, k, v = self.roped_and_cached(i, q, k, v, a.ropes[i], a.head_dim)
        window = a.sliding_window if a.layer_types[i] == SLIDING else None
        return gemma_attention(q, k, v, attention_bias(t, attention_mask, window),
                               a.query_pre_attn_scalar ** -0.5, a.attn_logit_softcapping)

    def layer(self, i: int, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
              linear: LinearHook = dense_linear,
              grouped_linear: GroupedLinearHook = dense_grouped_linear) -> jax.Array:
        """Decoder layer i: h += post_attn_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))."""
        p, eps = self.layer_prefix(i), self.args.rms_norm_eps
        x = gemma_rms_norm(hidden, params[f"{p}.input_layernorm.weight"], eps)
        x = self.attention(i, params, x, attention_mask, linear)
        hidden = hidden + gemma_rms_norm(x, params[f"{p}.post_attention_layernorm.weight"], eps)
        x = gemma_rms_norm(hidden, params[f"{p}.pre_feedforward_layernorm.weight"], eps)
        x = self.mlp(i, params, x, attention_mask, linear, grouped_linear)
        return hidden + gemma_rms_norm(x, params[f"{p}.post_feedforward_layernorm.weight"], eps)

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q/k/v and pre_feedforward_layernorm -> gate/up, each a gain 1 + w.

        Gemma's sandwich norms: post_attention_layernorm and post_feedforward_layernorm norm the
        outputs of o_proj and down_proj on their way to the residual, feeding no linear.
        """
        return [SmoothingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                               norm_offset=1.0),
                SmoothingGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), norm_offset=1.0)]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """v -> o and up -> down as for Llama: Gemma 3's q/k norms and Gemma 2's soft-capping act on the
        attention scores, never on v; down_proj's input is gelu(gate) * up."""
        return [value_output_group(self.args), UP_DOWN_GROUP]

    def head(self, params: Mapping, hidden: jax.Array, attention_mask: jax.Array | None = None,
             linear: LinearHook = dense_linear) -> jax.Array:
        """Final norm, lm_head and the final soft-cap: logits float32 [B, T, vocab]."""
        names = self.head_tensor_names()
        x = gemma_rms_norm(hidden, params[names[0]], self.args.rms_norm_eps)
        return soft_cap(linear(self.lm_head, x, params[names[1]], None), self.args.final_logit_softcapping)
