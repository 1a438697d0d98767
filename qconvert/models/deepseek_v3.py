"""DeepSeek-V3 in JAX (DeepSeek-V3, R1, V3.1; Kimi-K2 by the same architecture): multi-head latent attention
with yarn RoPE, dense first layers, then routed SwiGLU experts beside always-on shared experts.

Attention (MLA) on the normed hidden states x, per head h:

    q             = q_b_proj(q_a_layernorm(q_a_proj(x)))      (q_proj(x) when q_lora_rank is null)
    c, k_pe       = kv_a_proj_with_mqa(x) split at kv_lora_rank     (k_pe: one RoPE key all heads share)
    k_nope, v     = kv_b_proj(kv_a_layernorm(c)) split per head at qk_nope_head_dim
    out           = o_proj(softmax([q_nope, rope(q_pe)] . [k_nope, rope(k_pe)] * scale) v)

with scale = (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 under a
scaled RoPE (transformers' yarn_apply_mscale), and RoPE on interleaved channel pairs unless rope_interleave is
false. q_a_layernorm and kv_a_layernorm use epsilon 1e-6 whatever rms_norm_eps says, as transformers builds them.

Feed-forward: a layer below first_k_dense_replace, or off the moe_layer_freq beat (DeepSeek's and vLLM's
rule; transformers reads no moe_layer_freq, and every released config sets 1), is a dense SwiGLU `mlp`; the
others add the routed experts, chosen by moe.route_grouped_sigmoid from the router `mlp.gate` and its
`e_score_correction_bias`, to the shared experts (one SwiGLU of n_shared_experts * moe_intermediate_size).
The experts run through the grouped hook; the router is one of FLOAT_LINEARS and stays float.

DeepSeek-V3's checkpoints also hold multi-token-prediction layers after the last decoder layer (layer 61, with
its `eh_proj`), for speculative decoding: no forward here reads them, and transformers and vLLM's model skip
them, so they are written unchanged, float, and named in the loaders' ignore list.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp

from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError
from qconvert.models.activations import ACTIVATIONS, check_activation
from qconvert.models.config_values import config_bool, config_float, config_int, require_divides
from qconvert.models.decoder_shapes import Shapes, embed_and_head_shapes, layer_norm_shapes, swiglu_shapes
from qconvert.models.family import EXPERT, REMEDY_LEAD, SmoothingGroup
from qconvert.models.hooks import GroupedLinearHook, LinearHook, cached_kv
from qconvert.models.llama import (LlamaArgs, LlamaModel, attention_bias, gated_mlp, grouped_query_attention,
                                   rms_norm)
from qconvert.models.moe import expert_mixture, route_grouped_sigmoid
from qconvert.models.rope import RopeConfig, apply_rope, apply_rope_interleaved, rope_angles, yarn_mscale

SWIGLU = ("gate_proj", "up_proj", "down_proj")
ATTN = "self_attn"
Q_LORA = (f"{ATTN}.q_a_proj", f"{ATTN}.q_b_proj")
Q_DIRECT = (f"{ATTN}.q_proj",)
KV_AND_OUT = (f"{ATTN}.kv_a_proj_with_mqa", f"{ATTN}.kv_b_proj", f"{ATTN}.o_proj")
ROUTER = "mlp.gate"
CORRECTION_BIAS = f"{ROUTER}.e_score_correction_bias"
ROUTED = tuple(f"mlp.experts.{EXPERT}.{proj}" for proj in SWIGLU)
SHARED = tuple(f"mlp.shared_experts.{proj}" for proj in SWIGLU)
DENSE = tuple(f"mlp.{proj}" for proj in SWIGLU)
MTP_MARK = ".eh_proj.weight"  # a multi-token-prediction layer's own projection (of [embedding; hidden])
LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' RMSNorm default)


def mtp_layer_prefixes(tensor_names: Iterable[str]) -> tuple[str, ...]:
    """The module prefixes ("model.layers.61.") of the multi-token-prediction layers among a checkpoint's names."""
    return tuple(sorted(n[: -len(MTP_MARK)] + "." for n in tensor_names if n.endswith(MTP_MARK)))


REMEDY = (f"{REMEDY_LEAD}kv_b_proj value rows -> o_proj columns (one scale per value channel of each head; "
          "the key rows between keep scale 1), up_proj rows -> down_proj columns (each expert, the shared "
          "experts, the dense mlp)")


@dataclasses.dataclass(frozen=True)
class MlaArgs:
    """The config.json fields of multi-head latent attention."""

    q_lora_rank: int | None   # None: queries straight from q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    softmax_scale: float

    @classmethod
    def from_config(cls, config: dict[str, Any], rope: RopeConfig) -> "MlaArgs":
        nope, rope_dim = config_int(config, "qk_nope_head_dim"), config_int(config, "qk_rope_head_dim")
        if rope_dim % 2:
            raise InvalidCheckpointError(f"config.json: qk_rope_head_dim is {rope_dim}; RoPE rotates channel "
                                         "pairs, so it must be even")
        scale = (nope + rope_dim) ** -0.5
        if rope.rope_type != "default" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return cls(q_lora_rank=config_int(config, "q_lora_rank", default=None),
                   kv_lora_rank=config_int(config, "kv_lora_rank"), qk_nope_head_dim=nope,
                   qk_rope_head_dim=rope_dim, v_head_dim=config_int(config, "v_head_dim"),
                   rope_interleave=config_bool(config, "rope_interleave", True),  # transformers' default
                   softmax_scale=scale)


@dataclasses.dataclass(frozen=True)
class DeepseekMoeArgs:
    """The config.json fields of the routed and shared experts (absent ones take transformers' defaults)."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    sparse_layers: tuple[bool, ...]   # per layer: experts (True) or a dense MLP

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DeepseekMoeArgs":
        """Read and check the MoE fields; InvalidCheckpointError names a key that does not fit."""
        experts, top_k = config_int(config, "n_routed_experts"), config_int(config, "num_experts_per_tok")
        n_group, topk_group = config_int(config, "n_group", default=8), config_int(config, "topk_group", default=4)
        require_divides(config, "n_group", n_group, "n_routed_experts", experts)
        if experts // n_group < 2:
            raise InvalidCheckpointError(f"config.json: n_group = {n_group} leaves {experts // n_group} expert per "
                                         "group; the router ranks each group by its two best experts")
        if topk_group > n_group:
            raise InvalidCheckpointError(f"config.json: topk_group = {topk_group} exceeds n_group = {n_group}; "
                                         "the config is inconsistent")
        if top_k > topk_group * (experts // n_group):
            raise InvalidCheckpointError(
                f"config.json: num_experts_per_tok = {top_k} exceeds the {topk_group * (experts // n_group)} experts "
                f"of the topk_group = {topk_group} groups it chooses from; the config is inconsistent")
        for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if config.get(key, supported) != supported:
                raise UnsupportedModelError(f"config.json: {key} {config[key]!r} is not supported; DeepSeek-V3's "
                                            f"router is {key} {supported!r}")
        layers = config_int(config, "num_hidden_layers")
        first_sparse = config_int(config, "first_k_dense_replace", default=3, minimum=0)
        freq = config_int(config, "moe_layer_freq", default=1)
        return cls(n_routed_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=config_int(config, "moe_intermediate_size"),
                   n_shared_experts=config_int(config, "n_shared_experts", default=1),
                   n_group=n_group, topk_group=topk_group, norm_topk_prob=config_bool(config, "norm_topk_prob", True),
                   routed_scaling_factor=config_float(config, "routed_scaling_factor", 2.5),
                   sparse_layers=tuple(i >= first_sparse and i % freq == 0 for i in range(layers)))


def deepseek_args(config: dict[str, Any]) -> LlamaArgs:
    """The decoder sizes. num_key_value_heads plays no part: kv_b_proj gives every head its own key and value
    (transformers' default attention and vLLM ignore it too)."""
    heads = config_int(config, "num_attention_heads")
    check_activation(config.get("hidden_act", "silu"))
    layers = config_int(config, "num_hidden_layers")
    return LlamaArgs(
        hidden_size=config_int(config, "hidden_size"), intermediate_size=config_int(config, "intermediate_size"),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=config_int(config, "qk_nope_head_dim") + config_int(config, "qk_rope_head_dim"),
        vocab_size=config_int(config, "vocab_size"), rms_norm_eps=config_float(config, "rms_norm_eps", 1e-6),
        rope=RopeConfig.from_config(config), hidden_act=config.get("hidden_act", "silu"),
        tie_word_embeddings=config_bool(config, "tie_word_embeddings", False),
        attention_bias=config_bool(config, "attention_bias", False), sliding_windows=(None,) * layers)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Model(LlamaModel):
    """DeepseekV3ForCausalLM as pure functions of `params` (see LlamaModel): its layer, embedding and head, with
    MLA in `qkv_heads` / `attend` and the experts in `mlp`."""

    family = "deepseek_v3"
    hf_architectures = ("DeepseekV3ForCausalLM",)
    remedy = REMEDY
    # Every linear a layer may have (q_proj without q_lora_rank, q_a/q_b_proj with it; experts, or a dense MLP);
    # layer_modules(i) gives layer i's own, in call order. The router stays float.
    LAYER_LINEARS = Q_DIRECT + Q_LORA + KV_AND_OUT + (ROUTER,) + ROUTED + SHARED
    DENSE_LINEARS = Q_LORA + KV_AND_OUT + DENSE
    FLOAT_LINEARS = (ROUTER,)
    # Measured (bench/vllm_kv_cache.py's harness, ../shared/vllm): vLLM 0.33 maps `self_attn.k_scale` to
    # `self_attn.attn.k_scale`, which an MLA model does not have, and drops it with a warning.
    kv_cache_refusal = ("vLLM reads no per-tensor scale named self_attn.k_scale for multi-head latent attention "
                        "(it drops it), so the folder would serve with scale 1.0")

    mla: MlaArgs = MlaArgs(None, 1, 1, 2, 1, True, 1.0)
    moe: DeepseekMoeArgs = DeepseekMoeArgs(2, 1, 1, 1, 1, 1, True, 1.0, ())

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DeepseekV3Model":
        args = deepseek_args(config)
        return cls(args, mla=MlaArgs.from_config(config, args.rope), moe=DeepseekMoeArgs.from_config(config))

    @classmethod
    def linear_names(cls, tensor_names: Iterable[str]) -> list[str]:
        """The decoder layers' quantizable linears; a multi-token-prediction layer's stay float."""
        names = list(tensor_names)
        mtp = mtp_layer_prefixes(names)
        return [m for m in super().linear_names(names) if not m.startswith(mtp)]

    def carried_tensors(self, tensor_names: Iterable[str]) -> set[str]:
        """The tensors of the multi-token-prediction layers past the decoder's, which no forward reads and the
        conversion writes unchanged."""
        decoder = {self.layer_prefix(i) + "." for i in range(self.num_layers)}
        names = list(tensor_names)
        mtp = tuple(p for p in mtp_layer_prefixes(names) if p not in decoder)
        return {n for n in names if n.startswith(mtp)}

    @property
    def num_experts(self) -> int:
        return self.moe.n_routed_experts

    def _attention_modules(self) -> tuple[str, ...]:
        return (Q_LORA if self.mla.q_lora_rank else Q_DIRECT) + KV_AND_OUT

    def layer_modules(self, i: int) -> tuple[str, ...]:
        """Layer i's attention linears, then the router, experts and shared experts, or the dense MLP."""
        feed_forward = (ROUTER,) + ROUTED + SHARED if self.moe.sparse_layers[i] else DENSE
        return self._attention_modules() + feed_forward

    def layer_signature(self, i: int) -> tuple:
        return super().layer_signature(i) + (self.moe.sparse_layers[i],)

    def _latent_norms(self, i: int) -> list[str]:
        p = f"{self.layer_prefix(i)}.{ATTN}"
        return ([f"{p}.q_a_layernorm.weight"] if self.mla.q_lora_rank else []) + [f"{p}.kv_a_layernorm.weight"]

    def layer_tensor_names(self, i: int) -> list[str]:
        """Llama's (the norms, the linears' weights and biases) plus the latent norms and the router's bias."""
        bias = [f"{self.layer_prefix(i)}.{CORRECTION_BIAS}"] if self.moe.sparse_layers[i] else []
        return super().layer_tensor_names(i) + self._latent_norms(i) + bias

    def biased(self, proj: str) -> bool:
        """attention_bias gives q_a_proj, kv_a_proj_with_mqa and o_proj a bias (transformers' layout)."""
        return self.args.attention_bias and proj in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")

    def expected_shapes(self) -> Shapes:
        """Every tensor the forward reads, with the shape config.json implies (lm_head omitted when tied)."""
        a, m, e = self.args, self.mla, self.moe
        heads, hidden = a.num_attention_heads, a.hidden_size
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        shapes = embed_and_head_shapes(self)
        for i in range(self.num_layers):
            p, attn = self.layer_prefix(i), f"{self.layer_prefix(i)}.{ATTN}"
            shapes.update(layer_norm_shapes(self, i))
            linears = {"kv_a_proj_with_mqa": (m.kv_lora_rank + m.qk_rope_head_dim, hidden),
                       "kv_b_proj": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                       "o_proj": (hidden, heads * m.v_head_dim)}
            if m.q_lora_rank:
                linears.update(q_a_proj=(m.q_lora_rank, hidden), q_b_proj=(heads * qk, m.q_lora_rank))
                shapes[f"{attn}.q_a_layernorm.weight"] = (m.q_lora_rank,)
            else:
                linears["q_proj"] = (heads * qk, hidden)
            shapes[f"{attn}.kv_a_layernorm.weight"] = (m.kv_lora_rank,)
            for proj, shape in linears.items():
                shapes[f"{attn}.{proj}.weight"] = shape
                if self.biased(proj):
                    shapes[f"{attn}.{proj}.bias"] = (shape[0],)
            if not e.sparse_layers[i]:
                shapes.update(swiglu_shapes(f"{p}.mlp", hidden, a.intermediate_size))
                continue
            shapes[f"{p}.{ROUTER}.weight"] = (e.n_routed_experts, hidden)
            shapes[f"{p}.{CORRECTION_BIAS}"] = (e.n_routed_experts,)
            for x in range(e.n_routed_experts):
                shapes.update(swiglu_shapes(f"{p}.mlp.experts.{x}", hidden, e.moe_intermediate_size))
            shared = e.n_shared_experts * e.moe_intermediate_size
            shapes.update(swiglu_shapes(f"{p}.mlp.shared_experts", hidden, shared))
        return shapes

    def qkv_heads(self, i: int, params: Mapping, x: jax.Array,
                  linear: LinearHook) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [B, H, T, qk_nope + qk_rope] (RoPE not yet applied to the last qk_rope channels), keys (the
        shared RoPE key, rotated, repeated per head) and values [B, H, T, v_head_dim]: keys and values from the
        cache's view of the compressed latent and the rotated key (_cached_latent)."""
        m, heads, attn = self.mla, self.args.num_attention_heads, f"{self.layer_prefix(i)}.{ATTN}"
        b, t, _ = x.shape
        project = functools.partial(self._linear, linear, params)
        if m.q_lora_rank:
            latent = rms_norm(project(f"{attn}.q_a_proj", x), params[f"{attn}.q_a_layernorm.weight"], LATENT_NORM_EPS)
            q = project(f"{attn}.q_b_proj", latent)
        else:
            q = project(f"{attn}.q_proj", x)
        q = q.reshape(b, t, heads, -1).transpose(0, 2, 1, 3)
        compressed = project(f"{attn}.kv_a_proj_with_mqa", x)
        latent = rms_norm(compressed[..., :m.kv_lora_rank], params[f"{attn}.kv_a_layernorm.weight"], LATENT_NORM_EPS)
        k_pe = self._roped(compressed[..., m.kv_lora_rank:][:, None])  # [B, 1, T, qk_rope]
        latent, k_pe = self._cached_latent(attn, latent, k_pe)
        kv = project(f"{attn}.kv_b_proj", latent).reshape(b, t, heads, -1).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (b, heads, t, m.qk_rope_head_dim))], axis=-1)
        return q, k, v

    def attend(self, i: int, q: jax.Array, k: jax.Array, v: jax.Array, attention_mask) -> jax.Array:
        """RoPE on the last qk_rope_head_dim channels of q (k's are rotated already), then causal attention at
        the MLA scale."""
        m, t = self.mla, q.shape[2]
        q = jnp.concatenate([q[..., :m.qk_nope_head_dim], self._roped(q[..., m.qk_nope_head_dim:])], axis=-1)
        return grouped_query_attention(q, k, v, attention_bias(t, attention_mask, None), scale=m.softmax_scale)

    def _roped(self, x: jax.Array) -> jax.Array:
        """RoPE (interleaved where the config says so) on x [..., T, qk_rope_head_dim]."""
        m = self.mla
        cos, sin = rope_angles(self.args.rope, m.qk_rope_head_dim, x.shape[-2])
        return (apply_rope_interleaved if m.rope_interleave else apply_rope)(x, cos, sin)

    def _cached_latent(self, attn: str, latent: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The compressed latent [B, T, kv_lora_rank] and the rotated key [B, 1, T, qk_rope] as MLA's KV cache
        holds them: one entry a token, [latent, key], under one scale (vLLM's concat_and_cache_mla takes
        k_scale for both), handed to models.hooks.cached_kv as keys and as values alike."""
        entry = jnp.concatenate([latent[:, None], k_pe], axis=-1)
        entry, _ = cached_kv(attn, entry, entry)
        return entry[:, 0, :, :latent.shape[-1]], entry[..., latent.shape[-1]:]

    def mlp(self, i: int, params: Mapping, x: jax.Array, attention_mask, linear: LinearHook,
            grouped_linear: GroupedLinearHook) -> jax.Array:
        """The routed experts plus the shared experts, or a dense SwiGLU."""
        if not self.moe.sparse_layers[i]:
            return super().mlp(i, params, x, attention_mask, linear, grouped_linear)
        e, p = self.moe, self.layer_prefix(i)
        b, t, hidden = x.shape
        # The router sees x as [B, T, hidden] like every other linear, so observers can tell padding by the mask.
        router_logits = linear(f"{p}.{ROUTER}", x, params[f"{p}.{ROUTER}.weight"], None)
        experts, weights = route_grouped_sigmoid(
            router_logits.reshape(b * t, e.n_routed_experts), params[f"{p}.{CORRECTION_BIAS}"],
            top_k=e.num_experts_per_tok, n_group=e.n_group, topk_group=e.topk_group, normalize=e.norm_topk_prob,
            scaling=e.routed_scaling_factor)

        def names(proj: str) -> list[str]:
            return [f"{p}.mlp.experts.{n}.{proj}" for n in range(e.n_routed_experts)]

        routed = expert_mixture(x, experts, weights, e.n_routed_experts, attention_mask, expert_names=names,
                                projections=SWIGLU, params=params, grouped_linear=grouped_linear,
                                act=ACTIVATIONS[self.args.hidden_act])
        project = functools.partial(self._linear, linear, params)
        return routed + gated_mlp(project, f"{p}.mlp.shared_experts", x, self.args.hidden_act)

    def layer_norm_groups(self, i: int) -> list[SmoothingGroup]:
        """input_layernorm -> q_a_proj (q_proj) and kv_a_proj_with_mqa; q_a_layernorm -> q_b_proj;
        kv_a_layernorm -> kv_b_proj; post_attention_layernorm -> the dense gate/up_proj, or the shared experts'
        and every expert's gate/up_proj and the router, which absorbs s so the float model is unchanged but
        stays float."""
        first = Q_LORA[0] if self.mla.q_lora_rank else Q_DIRECT[0]
        groups = [SmoothingGroup("input_layernorm", (first, KV_AND_OUT[0]))]
        if self.mla.q_lora_rank:
            groups.append(SmoothingGroup(f"{ATTN}.q_a_layernorm", (Q_LORA[1],)))
        groups.append(SmoothingGroup(f"{ATTN}.kv_a_layernorm", (KV_AND_OUT[1],)))
        if not self.moe.sparse_layers[i]:
            return groups + [SmoothingGroup("post_attention_layernorm", DENSE[:2])]
        experts = tuple(f"mlp.experts.{n}.{proj}" for n in range(self.num_experts) for proj in SWIGLU[:2])
        # The shared experts (every token) first: --alpha auto searches on the first linear's input.
        return groups + [SmoothingGroup("post_attention_layernorm", (*SHARED[:2], *experts, ROUTER))]

    def layer_linear_groups(self, i: int) -> list[SmoothingGroup]:
        """kv_b_proj's value rows -> o_proj: attention weighs each head's values with scores their scale does not
        touch, so value channel j of head h, kv_b_proj's row h * (qk_nope + v) + qk_nope + j, reaches o_proj's
        input column h * v + j alone; the key rows between keep scale 1. Then up_proj -> down_proj."""
        m = self.mla
        value_output = SmoothingGroup(KV_AND_OUT[1], (KV_AND_OUT[2],), head_dim=m.v_head_dim,
                                      source_offset=m.qk_nope_head_dim,
                                      source_stride=m.qk_nope_head_dim + m.v_head_dim)
        if not self.moe.sparse_layers[i]:
            owners = ["mlp"]
        else:
            owners = [f"mlp.experts.{n}" for n in range(self.num_experts)] + ["mlp.shared_experts"]
        return [value_output] + [SmoothingGroup(f"{o}.up_proj", (f"{o}.down_proj",)) for o in owners]
