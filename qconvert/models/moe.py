"""A top-k routed mixture of SwiGLU experts, shared by the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3), and the two routers: softmax top-k, and DeepSeek-V3's group-limited sigmoid top-k.

The experts run through the grouped hook (see hooks.py), three calls per layer:
all experts' gate projections, then their up projections, then their down
projections. x holds one row per (token, chosen expert) pair sorted by expert;
padding tokens are routed to no expert: their rows sit past sum(group_sizes)
and come out zero, so they neither cost compute nor show up in calibration
statistics.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from qconvert.models.hooks import GroupedLinearHook


def route(router_logits: jax.Array, top_k: int, normalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token and their weights: softmax over all experts, the k largest kept
    (and renormalized to sum to 1 when `normalize`). Returns (expert ids int32 [N, k], weights float32 [N, k])."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def route_grouped_sigmoid(router_logits: jax.Array, correction_bias: jax.Array, *, top_k: int, n_group: int,
                          topk_group: int, normalize: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router (its `noaux_tc`): sigmoid scores; the experts are chosen on score + correction
    bias, among the `topk_group` groups (of n_group equal ones) whose two best biased scores sum highest;
    their weights are the unbiased scores (renormalized to sum to 1 when `normalize`) times `scaling`.
    Returns (expert ids int32 [N, k], weights float32 [N, k])."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores + jnp.asarray(correction_bias, jnp.float32)
    n, n_experts = choice.shape
    per_group = n_experts // n_group
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(n, n_group, per_group), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, topk_group)
    kept = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], groups].set(True)
    choice = jnp.where(jnp.repeat(kept, per_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * scaling


def routed_experts(x: jax.Array, router_logits: jax.Array, attention_mask: jax.Array | None, *,
                   top_k: int, normalize: bool, expert_names: Callable[[str], Sequence[str]],
                   projections: tuple[str, str, str], params: Mapping[str, Any],
                   grouped_linear: GroupedLinearHook, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Sum over each token's top-k experts (softmax routing, `route`) of weight * down(act(gate(x)) * up(x)),
    float32 [B, T, hidden].

    `router_logits` [B, T, E]; `expert_names(proj)` gives the E module names of one
    projection, for proj in `projections` = (gate, up, down) names.
    """
    b, t, _ = x.shape
    n_experts = router_logits.shape[-1]
    experts, weights = route(router_logits.reshape(b * t, n_experts), top_k, normalize)
    return expert_mixture(x, experts, weights, n_experts, attention_mask, expert_names=expert_names,
                          projections=projections, params=params, grouped_linear=grouped_linear, act=act)


def expert_mixture(x: jax.Array, experts: jax.Array, weights: jax.Array, n_experts: int,
                   attention_mask: jax.Array | None, *, expert_names: Callable[[str], Sequence[str]],
                   projections: tuple[str, str, str], params: Mapping[str, Any],
                   grouped_linear: GroupedLinearHook, act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Sum over each token's chosen experts of weight * down(act(gate(x)) * up(x)), float32 [B, T, hidden]:
    `experts` int32 and `weights` float32 [B * T, k], as a router gives them."""
    b, t, hidden = x.shape
    top_k = experts.shape[-1]
    tokens = x.reshape(b * t, hidden)

    # One row per (token, expert) pair, sorted by expert; padding pairs get the
    # out-of-range id n_experts so they sort last, outside every group.
    real = (jnp.ones((b * t,), bool) if attention_mask is None
            else (jnp.asarray(attention_mask) > 0).reshape(b * t))
    pair_expert = jnp.where(real[:, None], experts, n_experts).reshape(-1)
    pair_token = jnp.repeat(jnp.arange(b * t), top_k)
    order = jnp.argsort(pair_expert, stable=True)
    group_sizes = jnp.sum(pair_expert[None, :] == jnp.arange(n_experts)[:, None], axis=1).astype(jnp.int32)
    rows = tokens[pair_token[order]]

    def experts_linear(proj: str, inputs: jax.Array) -> jax.Array:
        names = expert_names(proj)
        return grouped_linear(names, inputs, [params[f"{n}.weight"] for n in names], group_sizes)

    gate, up, down = projections
    out = experts_linear(down, act(experts_linear(gate, rows)) * experts_linear(up, rows))
    pair_weight = jnp.where(pair_expert < n_experts, weights.reshape(-1), 0.0)[order]
    out = jnp.where(pair_weight[:, None] != 0, out * pair_weight[:, None], 0.0)
    combined = jnp.zeros((b * t, hidden), jnp.float32).at[pair_token[order]].add(out)
    return combined.reshape(b, t, hidden)
