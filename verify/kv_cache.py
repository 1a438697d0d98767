"""The KV cache's FP8 scales in a converted folder: recomputed from the record bit for bit, and the cache they make.

qconvert.json's `kv_cache` records each attention block's calibrated max|k| and max|v|; the folder's
`k_scale` / `v_scale` must be exactly formats.kv_cache.kv_scale of them (an edited scale fails), and no other
block may carry scales. The whole-model check then runs the converted model with every block's keys and
values rounded as an FP8 E4M3 cache stores them: x / scale saturated to +-448, rounded to E4M3, times scale.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.kv_cache import FP8_E4M3_MAX, is_kv_scale, kv_scale_tensors


def recorded_scales(kv_cache: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The scale tensors the record's maxima give, by name (empty for a record that is not an object)."""
    absmax = kv_cache.get("absmax") if isinstance(kv_cache, Mapping) else None
    scales = {}
    for block, pair in (absmax or {}).items() if isinstance(absmax, Mapping) else ():
        if isinstance(pair, Mapping) and all(isinstance(pair.get(p), (int, float)) for p in ("keys", "values")):
            scales.update(kv_scale_tensors(block, pair["keys"], pair["values"]))
    return scales


def check_kv_scales(kv_cache: Mapping[str, Any] | None, quantized) -> list[str]:
    """Each stored KV-cache scale against the one the record's maxima give, bit for bit; scales without a
    record, or a record without its scales, are problems too."""
    stored = [name for name in quantized.float_names if is_kv_scale(name)]
    if kv_cache is None:
        return [f"{quantized.file_of(name).name}: tensor {name} is a KV-cache scale, but qconvert.json records no "
                "kv_cache" for name in stored[:1]]
    expected, problems = recorded_scales(kv_cache), []
    if not expected:
        return ["qconvert.json: kv_cache records no calibrated maxima to check the KV-cache scales against"]
    for name in sorted(set(stored) - set(expected)):
        problems.append(f"{quantized.file_of(name).name}: tensor {name} is a KV-cache scale qconvert.json does not "
                        "record")
    for name, scale in sorted(expected.items()):
        if name not in quantized:
            problems.append(f"{quantized.folder.name}: tensor {name} is missing (qconvert.json's kv_cache records it)")
            continue
        got = np.asarray(quantized.get(name))
        if got.dtype != scale.dtype or got.shape != scale.shape or got.tobytes() != scale.tobytes():
            problems.append(f"{quantized.file_of(name).name}: tensor {name} is {got.dtype}{list(got.shape)} "
                            f"{got.ravel()[:1].tolist()}, but the recorded maximum gives {scale.tolist()} "
                            "(max|x| / 448): edited after conversion, or written from other statistics")
    return problems


def fp8_cache(keys: jax.Array, scale: float) -> jax.Array:
    """Keys or values as an FP8 E4M3 cache with per-tensor `scale` holds them (vLLM's reading: x / scale,
    saturated, rounded to E4M3, times scale)."""
    s = jnp.float32(scale)
    stored = jnp.clip(keys.astype(jnp.float32) / s, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return stored.astype(jnp.float32) * s


def fp8_cache_tap(quantized, kv_cache: Mapping[str, Any] | None):
    """The models.hooks.cached_kv tap that rounds each block's keys and values with the folder's scales; None
    for a folder without them."""
    if kv_cache is None:
        return None
    blocks = {name.rsplit(".", 1)[0] for name in recorded_scales(kv_cache)}
    scales = {block: (float(np.asarray(quantized.get(f"{block}.k_scale")).ravel()[0]),
                      float(np.asarray(quantized.get(f"{block}.v_scale")).ravel()[0])) for block in blocks}

    def tap(name, keys, values):
        if name not in scales:
            return keys, values
        k_scale, v_scale = scales[name]
        return fp8_cache(keys, k_scale), fp8_cache(values, v_scale)

    return tap
