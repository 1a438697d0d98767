"""gpt-oss in JAX (GptOssForCausalLM): Llama's pre-norm decoder with biased attention projections, attention
sinks, sliding-window and full attention layers by `layer_types`, yarn RoPE, and a top-k routed mixture of
clamped-SwiGLU experts with biases.

    self_attn.{q,k,v,o}_proj          linears with biases (quantized)
    self_attn.sinks                   [heads]: one extra logit per head in every softmax, its value dropped
    mlp.router                        linear [experts, hidden] with a bias (float, as every router): top-k of
                                      its logits, softmax over those k
    mlp.experts.gate_up_proj          [experts, hidden, 2 x intermediate], gate and up interleaved (columns
                                      2j and 2j + 1), and gate_up_proj_bias [experts, 2 x intermediate]
    mlp.experts.down_proj             [experts, intermediate, hidden], and down_proj_bias [experts, hidden]

An expert computes gate = min(g, limit), up = clip(u, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate),
then down (transformers' GptOssExperts; alpha `swiglu_alpha`, 1.702, limit `swiglu_limit`, 7).

The experts are stored fused, 3-D, as transformers saves them (the MXFP4 release: formats/fp4_sources.py reads
them as float). They are kept float and written as read, and the linears quantized are the attention projections,
because no loader reads a quantized gpt-oss expert that a compressed-tensors folder can hold:

- transformers builds them as one GptOssExperts parameter per projection, not as linears, and has no conversion
  rule that merges per-expert tensors into them, compressed or dequantized (tests/models/test_gpt_oss_transformers.py);
- vLLM 0.33's fp8 and NVFP4 fused-MoE methods allocate no expert bias, and its int4 method takes gpt-oss experts
  only under vLLM's own parameter names (experts.{e}.w13_weight_packed), not under compressed-tensors module names
  (tests/models/test_gpt_oss_vllm.py). With the experts in the ignore list it loads them as its float MoE layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from qconvert.formats.errors import InvalidCheckpointError
from qconvert.models.config_values import config_float, config_int
from qconvert.models.family import REMEDY_LEAD, SmoothingGroup
from qconvert.models.hooks import GroupedLinearHook, LinearHook, as_float32
from qconvert.models.llama import (ATTENTION_LINEARS, VALUE_OUTPUT_REMEDY, LlamaArgs, LlamaModel, attention_bias,
                                   value_output_group)

SLIDING, FULL = "sliding_attention", "full_attention"
ROUTER = "mlp.router"
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class GptOssArgs:
    """The config.json fields of gpt-oss's experts and attention layers."""

    num_local_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GptOssArgs":
        experts, per_token = config_int(config, "num_local_experts"), config_int(config, "num_experts_per_tok")
        if per_token > experts:
            raise InvalidCheckpointError(f"config.json: num_experts_per_tok = {per_token} exceeds "
                                         f"num_local_experts = {experts}; the config is inconsistent")
        return cls(experts, per_token, config_float(config, "swiglu_alpha", 1.702),
                   config_float(config, "swiglu_limit", 7.0))


def layer_windows(config: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window: `sliding_window` on the layers `layer_types` calls sliding (transformers'
    default: the even ones), none on the full ones."""
    types = config.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {SLIDING, FULL}:
        raise InvalidCheckpointError(f"config.json: layer_types is {types!r}; it must list {layers} of "
                                     f"{SLIDING!r} and {FULL!r}")
    window = config_int(config, "sliding_window") if SLIDING in types else None
    return tuple(window if t == SLIDING else None for t in types)


def sink_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, sinks: jax.Array) -> jax.Array:
    """softmax over [q k^T / sqrt(d) + bias, sink] (the sink's share dropped) times v; q [B, H, T, d], k and v
    [B, KV, T, d] shared by H/KV heads, sinks [H]."""
    repeats = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, repeats, axis=1), jnp.repeat(v, repeats, axis=1)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=HIGHEST) * q.shape[-1] ** -0.5 + bias
    sink = jnp.broadcast_to(as_float32(sinks)[None, :, None, None], (*scores.shape[:3], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v, precision=HIGHEST)


@dataclasses.dataclass(frozen=True)
class GptOssModel(LlamaModel):
    """GptOssForCausalLM: LlamaModel's embedding, norms and head; sink attention; float fused experts."""

    family = "gpt_oss"
    hf_architectures = ("GptOssForCausalLM",)
    remedy = f"{REMEDY_LEAD}{VALUE_OUTPUT_REMEDY}"
    # Attention, then the router, which stays float; the fused experts are no linears (see the module's text).
    LAYER_LINEARS = ATTENTION_LINEARS + (ROUTER,)
    FLOAT_LINEARS = (ROUTER,)
    # The fused experts stay float: the loaders' ignore list names them, so that one that builds them as a
    # quantized MoE layer under a compressed-tensors config (vLLM) reads them as float.
    float_towers = (r"model\.layers\.[0-9]+\.mlp\.experts",)

    moe: GptOssArgs = GptOssArgs(1, 1, 1.702, 7.0)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GptOssModel":
        args = LlamaArgs.from_config({"attention_bias": True, **config})
        args = dataclasses.replace(args, sliding_windows=layer_windows(config, args.num_hidden_layers))
        return cls(args, moe=GptOssArgs.from_config(config))

    @property
    def num_experts(self) -> int:
        return self.moe.num_local_experts

    def biased(self, proj: str) -> bool:
        return proj == "router" or proj in ("q_proj", "k_proj", "v_proj", "o_proj") and self.args.attention_bias

    def linear_shapes(self, i: int) -> dict[str, tuple[int, int]]:
        """[out, in] of layer i's attention linears and router as config.json implies them."""
        shapes = {m: s for m, s in super().linear_shapes(i).items() if ".self_attn." in m}
        shapes[f"{self.layer_prefix(i)}.{ROUTER}"] = (self.num_experts, self.args.hidden_size)
        return shapes

    def _layer_extras(self, i: int) -> dict[str, tuple[int, ...]]:
        """Layer i's tensors besides its norms and linears: the sinks and the fused experts with their biases."""
        a, e, p = self.args, self.num_experts, self.layer_prefix(i)
        return {f"{p}.self_attn.sinks": (a.num_attention_heads,),
                f"{p}.mlp.experts.gate_up_proj": (e, a.hidden_size, 2 * a.intermediate_size),
                f"{p}.mlp.experts.gate_up_proj_bias": (e, 2 * a.intermediate_size),
                f"{p}.mlp.experts.down_proj": (e, a.intermediate_size, a.hidden_size),
                f"{p}.mlp.experts.down_proj_bias": (e, a.hidden_size)}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes()
        for i in range(self.num_layers):
            shapes.update(self._layer_extras(i))
        return shapes

    def layer_tensor_names(self, i: int) -> list[str]:
        return [*super().layer_tensor_names(i), *self._layer_extras(i)]

    def layer_signature(self, i: int) -> tuple:
        return (self.args.sliding_windows[i],)

    def attention(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook) -> jax.Array:
        """Layer i's self-attention: yarn RoPE on its heads, sink attention (a sliding window where the layer
        has one), o_proj."""
        q, k, v = self.qkv_heads(i, params, x, linear)
        q, k, v = self.roped_and_cached(i, q, k, v, self.args.rope, self.rotary_dim)
        bias = attention_bias(q.shape[2], attention_mask, self.args.sliding_windows[i])
        out = sink_attention(q, k, v, bias, params[f"{self.layer_prefix(i)}.self_attn.sinks"])
        b, heads, t, head_dim = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, t, heads * head_dim)
        return self._linear(linear, params, f"{self.layer_prefix(i)}.self_attn.o_proj", out)

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """Each token's top-k experts (softmax over the k router logits) of the clamped SwiGLU, float32."""
        p = self.layer_prefix(i)
        logits = self._linear(linear, params, f"{p}.{ROUTER}", x)
        b, t, hidden = x.shape
        top, experts = jax.lax.top_k(logits.reshape(b * t, -1).astype(jnp.float32), self.moe.num_experts_per_tok)
        weights = jax.nn.softmax(top, axis=-1)
        return self._experts(params, f"{p}.mlp.experts", x.reshape(b * t, hidden), experts, weights,
                             attention_mask).reshape(b, t, hidden)

    def _experts(self, params: Mapping, p: str, tokens: jax.Array, experts: jax.Array, weights: jax.Array,
                 attention_mask) -> jax.Array:
        """Sum over each token's chosen experts of weight * (down(swiglu(gate_up(x) + b)) + b): one row per
        (token, expert) pair sorted by expert, each group through its expert's fused weights (ragged_dot);
        padding tokens' pairs sort last, outside every group."""
        n, top_k = experts.shape
        e = self.num_experts
        real = jnp.ones((n,), bool) if attention_mask is None else (jnp.asarray(attention_mask) > 0).reshape(n)
        pair_expert = jnp.where(real[:, None], experts, e).reshape(-1)
        pair_token = jnp.repeat(jnp.arange(n), top_k)
        order = jnp.argsort(pair_expert, stable=True)
        group_sizes = jnp.sum(pair_expert[None, :] == jnp.arange(e)[:, None], axis=1).astype(jnp.int32)
        rows, row_expert = tokens[pair_token[order]], jnp.minimum(pair_expert[order], e - 1)
        gate_up = jax.lax.ragged_dot(rows, as_float32(params[f"{p}.gate_up_proj"]), group_sizes, precision=HIGHEST)
        gate_up = gate_up + as_float32(params[f"{p}.gate_up_proj_bias"])[row_expert]
        limit, alpha = self.moe.swiglu_limit, self.moe.swiglu_alpha
        gate, up = jnp.minimum(gate_up[:, 0::2], limit), jnp.clip(gate_up[:, 1::2], -limit, limit)
        hidden = (up + 1) * gate * jax.nn.sigmoid(gate * alpha)
        out = jax.lax.ragged_dot(hidden, as_float32(params[f"{p}.down_proj"]), group_sizes, precision=HIGHEST)
        out = out + as_float32(params[f"{p}.down_proj_bias"])[row_expert]
        pair_weight = jnp.where(pair_expert < e, weights.reshape(-1), 0.0)[order]
        out = jnp.where(pair_weight[:, None] != 0, out * pair_weight[:, None], 0.0)
        return jnp.zeros(tokens.shape, jnp.float32).at[pair_token[order]].add(out)

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q/k/v (post_attention_layernorm feeds the router and the float experts only)."""
        return [SmoothingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """v_proj -> o_proj: the sink adds a logit, not a value, so attention stays linear in V per head."""
        return [value_output_group(self.args)]
