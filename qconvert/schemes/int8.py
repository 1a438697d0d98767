"""`--scheme int8`: int8 weights per output channel, float activations (W8A16), compressed-tensors pack-quantized."""

from __future__ import annotations

import numpy as np

from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_int8 import PackQuantizedInt8
from qconvert.formats.qarray import INT8_QMAX, QArray
from qconvert.quantizers import quantize_int8
from qconvert.scale_search import INT8_CLIP_GRID, int8_clip_search
from qconvert.schemes.base import ClipSearch, Scheme, Thresholds

INT8_CLIP = ClipSearch(INT8_CLIP_GRID, "per output channel: scale = c * absmax / 127")


class Int8(Scheme):
    """Symmetric int8 codes, scale = absmax / 127 per output row, activations left in float."""

    name = "int8"
    layout = PackQuantizedInt8()
    summary = "int8 weights per output channel, float activations (W8A16)"
    loads_in = "vLLM, transformers + compressed-tensors"
    clip = INT8_CLIP
    thresholds = Thresholds(
        min_layer_sqnr_db=30.0, min_layer_cosine=0.999, max_mean_kl=0.01,
        min_top1_agreement=0.90, max_perplexity_ratio=1.02, min_pooled_cosine=0.998,
    )

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_int8(weight, scale_dtype=scale_dtype, clip=clip)

    def gptq_grid(self):
        from qconvert.gptq import IntegerGrid

        return IntegerGrid(-INT8_QMAX, INT8_QMAX)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return int8_clip_search(weight)
