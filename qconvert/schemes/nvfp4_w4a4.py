"""`--scheme nvfp4`: NVFP4 weights exactly as `nvfp4a16` writes them, and NVFP4 input activations (W4A4).

Written as compressed-tensors' NVFP4 preset (docs/FORMATS.md, FP4): the weight tensors are nvfp4a16's, byte for
byte (round-to-nearest, GPTQ and AWQ alike, q/k/v and gate/up on one weight global scale), and each quantized
linear adds `input_global_scale`, float32 [1], from calibration: 448 * 6 / max|x| over every calibration token
of the input the quantized linear sees (after AWQ's folding), computed as compressed-tensors' generate_gparam
computes it in the model's dtype, as llm-compressor's static_minmax observer hands it the running max of the
activations. At run time the server rounds each token's activations per group of 16 inputs to E2M1 with an E4M3
scale e4m3(input_global_scale * absmax_group / 6), dividing by input_global_scale again after the matmul.

The linears a server fuses (q/k/v, gate/up) see one input, so they get one input_global_scale. An expert that
received no calibration token takes the largest max|x| of the same projection among its layer's experts, which
is what vLLM's MoE kernels that share one activation scale over the experts apply anyway.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_fp4 import NVFP4W4A4
from qconvert.schemes.base import Thresholds
from qconvert.formats.qarray import FP4_LEVELS
from qconvert.schemes.fp4 import E4M3_MAX, NVFP4_GROUP, e2m1_codes, in_dtype, nvfp4_global_scale
from qconvert.schemes.grids import E2M1_MAX
from qconvert.schemes.nvfp4 import NVFP4A16

EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def nvfp4_input_global_scale(absmax: float, dtype) -> np.float32:
    """compressed-tensors' generate_gparam of activations whose largest |x| is `absmax`, observed in the model's
    `dtype` (the observer's running max is a value of that dtype): 448 * 6 / absmax in that dtype, 1 where that
    is not finite (no calibrated input)."""
    return nvfp4_global_scale(float(in_dtype(np.float32(absmax), dtype)), dtype)


def nvfp4_activations(x: np.ndarray, global_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(E2M1 value times its E4M3 group scale, float64 [M, K]; the per-row factor 1 / global_scale, float64
    [M, 1]) of activations x [M, K], step by step as vLLM's NVFP4 activation quantizer (ref_nvfp4_quant) takes
    them in float32: s = e4m3(clamp(g * (absmax_group * (1/6)), +-448)), q = e2m1(clamp(x * (1 / (s * (1/g))),
    +-6)); a group whose scale is 0 is 0."""
    xf = np.asarray(x, np.float32)
    rows, cols = xf.shape
    groups = xf.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    g = np.float32(global_scale)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scale = g * (np.abs(groups).max(axis=2, keepdims=True) * np.float32(1.0 / E2M1_MAX))
        scale = np.clip(scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        effective = scale * (np.float32(1.0) / g)
        inverse = np.where(effective == 0, np.float32(0), np.float32(1.0) / effective)
        quotient = np.clip(groups * inverse, -E2M1_MAX, E2M1_MAX)
    # The nearest E2M1 value, a tie to the even mantissa: vLLM's cast_to_fp4 rule is e2m1_codes' (0.25 -> 0,
    # 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    values = FP4_LEVELS[e2m1_codes(quotient)].astype(np.float64) * scale.astype(np.float64)
    return values.reshape(rows, cols), np.full((rows, 1), 1.0 / np.float64(g))


def round_nvfp4_activations(x, global_scale):
    """jnp: activations x [M, K] as the server computes with them, nvfp4_activations' rounding times its scales
    (float32); `global_scale` one value or one per row ([M, 1])."""
    import jax.numpy as jnp

    from qconvert.schemes.grids import E2M1Grid

    x = jnp.asarray(x, jnp.float32)
    rows, cols = x.shape
    groups = x.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    g = jnp.broadcast_to(jnp.asarray(global_scale, jnp.float32).reshape(-1, 1, 1), (rows, 1, 1))
    scale = g * (jnp.max(jnp.abs(groups), axis=2, keepdims=True) * np.float32(1.0 / E2M1_MAX))
    scale = jnp.clip(scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    effective = scale * (np.float32(1.0) / g)
    inverse = jnp.where(effective == 0, np.float32(0), np.float32(1.0) / jnp.where(effective == 0, 1, effective))
    _, values = E2M1Grid().round(jnp.clip(groups * inverse, -E2M1_MAX, E2M1_MAX))
    return (values * effective).reshape(rows, cols)


class NVFP4(NVFP4A16):
    """NVFP4 weights (nvfp4a16's) and NVFP4 activations over a calibrated per-linear input global scale."""

    name = "nvfp4"
    layout = NVFP4W4A4()
    act_modes = ("dynamic",)
    calibrated_inputs = True
    # GPTQ was measured on Gemma 3 270M alone (perplexity change +46.6% -> +25.2%, KL 0.369 -> 0.239,
    # docs/ACCURACY.md): opt-in (--gptq) until it is measured on both real LLMs, as the other defaults were.
    default_gptq = False
    # Measured on SmolLM2-135M (round-to-nearest, the built-in calibration, verify's held-out text, 2-core CPU):
    # worst linear 12.8 dB (cosine 0.975, a v_proj), KL 0.449, top-1 0.590, perplexity x1.278, where nvfp4a16's
    # same weights give KL 0.254, top-1 0.684, x1.161: the 4-bit activations cost about as much again. Fidelity
    # >= 130 dB on CPU (the kernel and the float64 reference round the same activations); 40 dB as int4's.
    thresholds = Thresholds(
        min_layer_sqnr_db=8.0, min_layer_cosine=0.93, max_mean_kl=0.60,
        min_top1_agreement=0.50, max_perplexity_ratio=1.45, min_pooled_cosine=0.85,
        min_fidelity_sqnr_db=40.0,
    )

    def check_options(self, *, act: str, double_quant: bool, group_size, calibrates: bool) -> None:
        """`calibrates` here: smoothing flags given beside the calibration text, which nvfp4 does not take."""
        if act == "static" or calibrates:
            raise UsageError("--scheme nvfp4 calibrates one input global scale per linear from the --calib text and "
                             "rounds activations per group of 16 at run time: --act static, --alpha, --no-smooth "
                             "and --act-stats do not apply; drop them")
        super().check_options(act=act, double_quant=double_quant, group_size=group_size, calibrates=False)

    def input_scales(self, absmax: Mapping[str, float], dtypes: Mapping[str, np.dtype]) -> dict[str, float]:
        """Each linear's input_global_scale from the max|x| of its calibrated input: the fused shards' joint
        one, and for an expert no token reached, the largest of its projection among the layer's experts."""
        filled = dict(absmax)
        by_projection: dict[str, float] = {}
        for module, value in absmax.items():
            if EXPERT_INDEX.search(module):
                key = EXPERT_INDEX.sub(".experts.*.", module)
                by_projection[key] = max(by_projection.get(key, 0.0), float(value))
        for module, value in absmax.items():
            if EXPERT_INDEX.search(module) and not float(value) > 0:
                filled[module] = by_projection[EXPERT_INDEX.sub(".experts.*.", module)]
        joint = {**filled, **self.shared_absmax(sorted(filled), lambda m: float(filled[m]))}
        return {m: float(nvfp4_input_global_scale(joint[m], dtypes[m])) for m in sorted(joint)}

    def kernel_activations(self, x, input_scale):
        return round_nvfp4_activations(x, input_scale)

    def folder_activations(self, x: np.ndarray, input_scale: float | None) -> tuple[np.ndarray, np.ndarray]:
        if input_scale is None:
            raise ValueError("an nvfp4 linear's activations need its input_global_scale")
        return nvfp4_activations(x, input_scale)
