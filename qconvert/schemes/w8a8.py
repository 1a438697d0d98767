"""`--scheme w8a8`: SmoothQuant, int8 weights per output channel and int8 activations, compressed-tensors int-quantized."""

from __future__ import annotations

import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_w8a8 import IntQuantizedW8A8
from qconvert.schemes.base import Thresholds
from qconvert.schemes.int8 import Int8

# Where vLLM's int8 fused-MoE method refuses anything but dynamic per-token activations.
EXPERT_MARK = ".experts."


class W8A8(Int8):
    """int8 codes as they are, activations quantized per token at run time or per tensor (calibrated)."""

    name = "w8a8"
    layout = IntQuantizedW8A8()
    act_modes = ("dynamic", "static")
    calibrates = True
    # The clip search lowers each linear's output error on its calibration rows yet raised the perplexity of
    # real trained LLMs (docs/ACCURACY.md): opt-in, as for the other schemes.
    default_scale_search = False
    # GPTQ on the smoothed weights also lowered each layer's calibration error and also raised the perplexity
    # of SmolLM2-135M (docs/ACCURACY.md): opt-in (--gptq).
    default_gptq = False
    thresholds = Thresholds(
        min_layer_sqnr_db=20.0, min_layer_cosine=0.99, max_mean_kl=0.05,
        min_top1_agreement=0.80, max_perplexity_ratio=1.10, min_pooled_cosine=0.98,
    )
    static_thresholds = Thresholds(
        min_layer_sqnr_db=15.0, min_layer_cosine=0.98, max_mean_kl=0.15,
        min_top1_agreement=0.75, max_perplexity_ratio=1.15, min_pooled_cosine=0.95,
    )

    def check_modules(self, modules: list[str], flags: LayoutFlags) -> None:
        experts = [m for m in modules if EXPERT_MARK in m]
        if flags.static_act and experts:
            raise UsageError(f"--act static cannot serve this model's experts ({experts[0]}, ...): vLLM's int8 "
                             "fused-MoE kernel takes only dynamic per-token activations; use --act dynamic "
                             "(the default) for a mixture-of-experts model")

    def folder_activations(self, x: np.ndarray, input_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
        # FORMATS.md's rule: scale max|x| / 127 per token (float32; 1 for a zero row) or the static
        # input_scale, round half to even, clamp to +-127.
        xf = x.astype(np.float32)
        if input_scale is None:
            absmax = np.abs(xf).max(axis=1, keepdims=True)
            scale = np.where(absmax > 0, absmax / np.float32(127), np.float32(1)).astype(np.float32)
        else:
            scale = np.full((xf.shape[0], 1), np.float32(input_scale), np.float32)
        codes = np.clip(np.rint(xf / scale), -127, 127)
        return codes.astype(np.float64), scale.astype(np.float64)
