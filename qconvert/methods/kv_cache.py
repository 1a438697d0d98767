"""KV-cache FP8 scales as a step (`--kv-cache fp8`): per attention block, k_scale and v_scale from the keys after
RoPE and the values that calibration's tokens put in the cache, max|x| / 448 per tensor (formats/kv_cache.py).

The statistic is the layer's attention keys and values as the family hands them to its cache
(models.hooks.cached_kv), observed in the same pass as every other step's: with a step that rewrites layers
(GPTQ), a layer's keys and values come from its own float weights on the layers before it as rounded, as in
llm-compressor's sequential pipeline. The record keeps each block's calibrated maxima, from which verify
recomputes the stored scales bit for bit.
"""

from __future__ import annotations

from typing import Any, Sequence

from qconvert.calibration.observer import LayerStats
from qconvert.calibration.statistics import AttentionAbsMax, Statistic
from qconvert.formats.errors import UsageError
from qconvert.formats.kv_cache import FP8_E4M3_MAX, KV_CACHE_SCHEME, kv_scale_tensors
from qconvert.methods.loop import Results, Step

KV_SCALES = "KV-cache scales"  # the step's progress stage


def attention_blocks(model) -> list[str]:
    """The attention modules whose keys and values the model caches, in layer order; UsageError for a model
    that caches none a server reads per-tensor scales for, or with no forward pass (None: --any-architecture's
    weight-only decoders)."""
    if model is None:
        raise UsageError("--kv-cache fp8 calibrates the keys and values the model's forward pass computes, which "
                         "--any-architecture does not have for this model; convert without --kv-cache")
    blocks = getattr(model, "kv_cache_blocks", None)
    reason = getattr(model, "kv_cache_refusal", None)
    if blocks is None or reason:
        raise UsageError(f"--kv-cache fp8: {reason or 'this model has no attention whose keys and values a server caches'}; "
                         "convert without --kv-cache")
    return list(blocks())


class KVCacheScales(Step):
    """The step: every attention block's per-tensor FP8 scales once its layer's keys and values are complete."""

    stage = KV_SCALES

    def __init__(self, model, scheme: str = "fp8"):
        self.blocks, self.scheme = attention_blocks(model), scheme
        self.absmax: dict[str, dict[str, float]] = {}

    def statistics(self) -> Sequence[Statistic]:
        return [AttentionAbsMax(frozenset(self.blocks))]

    def stage_total(self) -> int:
        return len(self.blocks)

    def layer(self, stats: LayerStats, results: Results) -> None:
        found = {name: pair for name, pair in stats.of(AttentionAbsMax).items() if name in self.blocks}
        for name, pair in found.items():
            self.absmax[name] = {"keys": float(pair["keys"]), "values": float(pair["values"])}
            results.extra_tensors.update(kv_scale_tensors(name, pair["keys"], pair["values"]))
        if found:
            self.advance(len(self.absmax))

    def finish(self, results: Results) -> None:
        missing = [name for name in self.blocks if name not in self.absmax]
        if missing:  # a statistics file holds no keys or values
            raise UsageError(f"--kv-cache fp8 needs the keys and values of every attention block from calibration; "
                             f"{missing[0]} has none (--act-stats files hold only linear inputs): calibrate "
                             "instead of --act-stats, or convert without --kv-cache")
        results.extra_config["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
        results.records["kv_cache"] = self.record()

    def record(self) -> dict[str, Any]:
        """qconvert.json's `kv_cache`: the scheme, the rule, and each block's calibrated maxima."""
        return {"scheme": self.scheme, "dtype": "float8_e4m3fn", "strategy": "tensor",
                "rule": f"scale = max|x| / {FP8_E4M3_MAX:g} (float32), keys after RoPE, values as cached",
                "absmax": {name: self.absmax[name] for name in self.blocks}}
