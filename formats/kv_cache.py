"""The KV cache's FP8 scales on disk: compressed-tensors' `kv_cache_scheme` and each attention block's scales.

An FP8 (E4M3) KV cache stores keys after RoPE and values as x / scale; per tensor, scale = max|x| over the
calibration tokens / 448 (E4M3's largest finite value), in float32, so the largest calibrated value lands on
the format's largest. The folder holds `<attention>.k_scale` and `<attention>.v_scale`, float32 [1] (the shape
compressed-tensors gives a per-tensor scale; vLLM reads () or (1,)), and config.json's
`quantization_config.kv_cache_scheme` says how they were made (compressed-tensors' QuantizationArgs).
"""

from __future__ import annotations


import numpy as np

FP8_E4M3_MAX = 448.0
KV_CACHE_SCHEMES = ("fp8",)  # --kv-cache values (besides "none")
SCALE_NAMES = ("k_scale", "v_scale")  # keys, then values
KV_SCALE_KIND = "kv-cache scale"  # what `inspect` calls these tensors

# compressed-tensors' QuantizationArgs of a per-tensor, static, symmetric FP8 KV cache (llm-compressor writes
# these keys; vLLM checks num_bits, type, strategy, dynamic and symmetric).
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "group_size": None,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}


def kv_scale(absmax: float | np.ndarray) -> np.ndarray:
    """The stored scale of a calibrated max|x|: max|x| / 448 in float32, shape [1]; a max of 0 (an input no
    token reached) gives 1, never a zero a loader would divide by."""
    value = np.float32(absmax) / np.float32(FP8_E4M3_MAX)
    return np.asarray([value if value > 0 else np.float32(1.0)], np.float32)


def kv_scale_tensors(attention: str, keys_absmax: float, values_absmax: float) -> dict[str, np.ndarray]:
    """The two scale tensors of one attention block (`model.layers.N.self_attn`), by name."""
    return {f"{attention}.k_scale": kv_scale(keys_absmax), f"{attention}.v_scale": kv_scale(values_absmax)}


def is_kv_scale(name: str) -> bool:
    """Whether a tensor name is a KV-cache scale (`...self_attn.k_scale` / `v_scale`)."""
    return name.rsplit(".", 1)[-1] in SCALE_NAMES
