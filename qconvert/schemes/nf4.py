"""`--scheme nf4`: QLoRA NormalFloat-4 in blocks of 64, bitsandbytes' 4-bit serialization."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_nf4 import BitsandbytesNF4
from qconvert.formats.packing import dequantize_double_quant, double_quantize_absmax
from qconvert.formats.qarray import NF4_BLOCK_SIZE, NF4_LEVELS, QArray
from qconvert.models.module_roles import is_expert
from qconvert.quantizers import NF4_THRESHOLDS, quantize_nf4
from qconvert.rowwise import quantize_nf4_rows
from qconvert.scale_search import NF4_CLIP_GRID, nf4_clip_search
from qconvert.schemes.base import ClipSearch, Scheme, Thresholds


class NF4(Scheme):
    """16 NormalFloat levels times each block's absmax; blocks of 64 run over the flattened weight."""

    name = "nf4"
    layout = BitsandbytesNF4()
    summary = "NormalFloat-4 weights, blocks of 64 (QLoRA), optional double quantization"
    loads_in = "transformers + bitsandbytes only (vLLM 0.33 removed bitsandbytes)"
    vllm_loads = False
    takes_double_quant = True
    clip = ClipSearch(NF4_CLIP_GRID, "per block of 64: stored absmax = c * max|block|, values beyond it clip to +-1")
    thresholds = Thresholds(
        min_layer_sqnr_db=15.0, min_layer_cosine=0.98, max_mean_kl=0.10,
        min_top1_agreement=0.70, max_perplexity_ratio=1.25, min_pooled_cosine=0.95,
        min_fidelity_sqnr_db=40.0,
    )

    def layout_flags(self, *, act: str = "dynamic", double_quant: bool = False, group_size: int | str | None = None,
                     shapes: Mapping[str, tuple[int, int]] | None = None) -> LayoutFlags:
        return LayoutFlags(double_quant=double_quant)

    def check_modules(self, modules: list[str], flags: LayoutFlags) -> None:
        # Refused rather than kept float: the experts are most of a MoE model's weights, so an nf4 folder
        # with float experts would barely shrink, and int4 loads quantized experts in both loaders.
        experts = [m for m in modules if is_expert(m)]
        if experts and self.layout.loader_keeps_experts_float:
            raise UsageError(
                f"--scheme nf4 cannot quantize experts ({experts[0]} and {len(experts) - 1} more): transformers "
                "fuses them and its bitsandbytes 4-bit path keeps them float; use --scheme int4 (transformers "
                "and vLLM load its experts), or --exclude '*.experts.*' to keep them float")

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_nf4(weight, clip=clip)

    def quantize_rows(self, read_rows: Callable[[int, int], np.ndarray], shape: tuple[int, int],
                      dtype: np.dtype, flags: LayoutFlags) -> QArray:
        return quantize_nf4_rows(quantize_nf4, read_rows, shape, dtype)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return nf4_clip_search(weight, NF4_BLOCK_SIZE, NF4_LEVELS, NF4_THRESHOLDS)

    def gptq_grid(self):
        from qconvert.gptq import LevelGrid

        return LevelGrid(tuple(float(v) for v in NF4_LEVELS))

    def gptq_steps(self, q: QArray, flags: LayoutFlags) -> np.ndarray:
        # Each weight's block absmax as the folder stores it: double quantization rounds it first.
        absmax = np.asarray(q.scale, np.float32)
        if flags.double_quant:
            absmax = dequantize_double_quant(*double_quantize_absmax(absmax))
        return np.repeat(absmax, q.block_size)[:q.size].reshape(q.shape)

    def gptq_qarray(self, q: QArray, codes: np.ndarray) -> QArray:
        flat = np.asarray(codes).reshape(-1).astype(np.uint8)
        pairs = np.concatenate([flat, np.zeros(flat.size % 2, np.uint8)]).reshape(-1, 2)
        return dataclasses.replace(q, qvalue=((pairs[:, 0] << 4) | pairs[:, 1]).astype(np.uint8))

    def folder_weight(self, q: QArray) -> np.ndarray:
        # Loaders decode in float32 and cast to the model's dtype before the matmul.
        dtype = np.dtype(q.dtype) if np.dtype(q.dtype).kind in "fV" else np.dtype(np.float32)
        return np.asarray(q.dequantize(np.float32)).astype(dtype).astype(np.float64).reshape(q.shape)
