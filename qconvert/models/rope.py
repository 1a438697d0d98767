"""Rotary position embeddings: inverse frequencies (default, linear, llama3 and yarn scaling) and rotation
(channel i with i + r/2, or interleaved pairs 2i, 2i + 1)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """What config.json says about RoPE: base, scaling type and its parameters."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (as transformers computes it): the band of channels between beta_fast and beta_slow rotations over
    # the original context is interpolated; cos and sin are scaled by `attention_factor`, else by the ratio of
    # mscale's to mscale_all_dim's log-factor gain (DeepSeek), else by the gain at mscale 1.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0            # 0: not given
    mscale_all_dim: float = 0.0    # 0: not given; DeepSeek's attention also scales its softmax by it
    attention_factor: float | None = None
    truncate: bool = True          # the correction range rounded outward to whole channels

    @classmethod
    def from_config(cls, config: dict[str, Any], theta_key: str = "rope_theta") -> "RopeConfig":
        """Read `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (earlier).

        Every value is checked (InvalidCheckpointError, exit 6, naming the key): a
        base or factor that is not a positive finite number would give NaN angles.
        """
        params, where = _rope_blocks(config)

        def positive(name: str, default: float | None, fallback_key: str | None = None) -> float | None:
            if name in params and params[name] is not None:
                return _positive_number(where[name], params[name])
            if fallback_key is not None and config.get(fallback_key) is not None:
                return _positive_number(fallback_key, config[fallback_key])
            return default

        theta = positive("rope_theta", 10000.0, theta_key)
        rope_type = _rope_type(params, where)
        low, high = positive("low_freq_factor", 1.0), positive("high_freq_factor", 4.0)
        if rope_type == "llama3" and not high > low:
            raise InvalidCheckpointError(
                f"config.json: {where.get('high_freq_factor', 'high_freq_factor')} = {high} is not above "
                f"low_freq_factor = {low}; the llama3 RoPE scaling needs high > low")
        original = _original_positions(config, params, where)
        factor = positive("factor", 1.0)
        if rope_type == "yarn" and params.get("factor") is None:
            # transformers: the context the model was extended to over the one it was trained on.
            factor = _original_positions(config, {}, {}) / original
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidCheckpointError(f"config.json: {where['truncate']} is {truncate!r}; it must be true or false")
        return cls(theta=theta, rope_type=rope_type, factor=factor,
                   low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original,
                   # transformers reads a beta of 0 as not given (`or 32`).
                   beta_fast=positive("beta_fast", 32.0) if params.get("beta_fast") else 32.0,
                   beta_slow=positive("beta_slow", 1.0) if params.get("beta_slow") else 1.0,
                   mscale=_nonnegative(where, params, "mscale"),
                   mscale_all_dim=_nonnegative(where, params, "mscale_all_dim"),
                   attention_factor=positive("attention_factor", None), truncate=truncate)


def _positive_number(key: str, value: Any) -> float:
    """A RoPE base or factor: a positive finite number (exit 6 naming the key otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be a positive number")
    return float(value)


def _nonnegative(where: dict[str, str], params: dict[str, Any], name: str) -> float:
    """A yarn mscale: a finite number >= 0 (0 or absent: not given)."""
    value = params.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidCheckpointError(f"config.json: {where[name]} is {value!r}; it must be a number >= 0")
    return float(value)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's attention gain for a context `scale` times the original: 0.1 * mscale * ln(scale) + 1 (1 for
    scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (1 but for yarn)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_inverse_frequencies(inv_freq: np.ndarray, rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Channels that turn more than beta_fast times over the original context keep their speed, those that
    turn fewer than beta_slow times are slowed by `factor`, and a linear ramp blends the band between."""
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of the original (extrapolated) frequency
    return inv_freq / rope.factor * (1 - kept) + inv_freq * kept


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 [head_dim / 2]: the rotation speed of each pair of channels."""
    inv_freq = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
        # the band between is interpolated smoothly.
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(inv_freq, rope, head_dim)
    return inv_freq.astype(np.float32)


def rope_angles(rope: RopeConfig, head_dim: int, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim] for positions 0..T-1 (the two halves repeat), times the scaling's
    attention factor (yarn's; 1 otherwise)."""
    inv_freq = jnp.asarray(inverse_frequencies(rope, head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    gain = attention_factor(rope)
    if gain == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * gain, jnp.sin(angles) * gain


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the leading r = cos.shape[-1] channels of x [B, heads, T, head_dim]; channel i
    pairs with channel i + r/2; channels past r (partial rotary) pass unchanged."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rotated = jnp.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the channel pairs (2i, 2i + 1) of x [B, heads, T, r] by angle i (DeepSeek's layout; cos and sin
    as rope_angles gives them). The rotated pairs come out as transformers gives them, even channels first,
    then odd: a reordering that queries and keys share, so their products are the interleaved ones."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


def _rope_blocks(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The RoPE fields of `rope_parameters` and `rope_scaling` merged, and the key each came from."""
    params: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key in ("rope_parameters", "rope_scaling"):
        block = config.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise InvalidCheckpointError(f"config.json: {key} is {block!r}; it must be an object")
        params.update(block)
        where.update({name: f"{key}.{name}" for name in block})
    return params, where


def _rope_type(params: dict[str, Any], where: dict[str, str]) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        key = where.get("rope_type", where.get("type"))
        raise InvalidCheckpointError(f"config.json: {key} is {rope_type!r}; it must be a string")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; supported: " + ", ".join(SUPPORTED_ROPE_TYPES))
    return rope_type


def _original_positions(config: dict[str, Any], params: dict[str, Any], where: dict[str, str]) -> int:
    """original_max_position_embeddings of the scaling, else the model's max_position_embeddings."""
    original = params.get("original_max_position_embeddings")
    original_key = where.get("original_max_position_embeddings", "original_max_position_embeddings")
    if original is None:
        original, original_key = config.get("max_position_embeddings", 8192), "max_position_embeddings"
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise InvalidCheckpointError(f"config.json: {original_key} is {original!r}; it must be a whole "
                                     "number of at least 1")
    return original
