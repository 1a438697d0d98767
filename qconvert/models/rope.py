"""Rotary position embeddings: inverse frequencies (default, linear, llama3 scaling) and rotation."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidCheckpointError, UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """What config.json says about RoPE: base, scaling type and its parameters."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_config(cls, config: dict[str, Any], theta_key: str = "rope_theta") -> "RopeConfig":
        """Read `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (earlier).

        Every value is checked (InvalidCheckpointError, exit 6, naming the key): a
        base or factor that is not a positive finite number would give NaN angles.
        """
        params, where = _rope_blocks(config)

        def positive(name: str, default: float, fallback_key: str | None = None) -> float:
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
        return cls(theta=theta, rope_type=rope_type, factor=positive("factor", 1.0),
                   low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original)


def _positive_number(key: str, value: Any) -> float:
    """A RoPE base or factor: a positive finite number (exit 6 naming the key otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidCheckpointError(f"config.json: {key} is {value!r}; it must be a positive number")
    return float(value)


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
    return inv_freq.astype(np.float32)


def rope_angles(rope: RopeConfig, head_dim: int, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim] for positions 0..T-1 (the two halves repeat)."""
    inv_freq = jnp.asarray(inverse_frequencies(rope, head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the leading r = cos.shape[-1] channels of x [B, heads, T, head_dim]; channel i
    pairs with channel i + r/2; channels past r (partial rotary) pass unchanged."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rotated = jnp.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


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
