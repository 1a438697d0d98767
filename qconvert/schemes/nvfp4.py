"""`--scheme nvfp4a16` and `--scheme mxfp4a16`: E2M1 weights with group scales, float activations.

Written in compressed-tensors `nvfp4-pack-quantized` (groups of 16, E4M3 scales, a float32 global scale per
tensor) and `mxfp4-pack-quantized` (groups of 32, E8M0 scales). Plain rounding is compressed-tensors' own
round-to-nearest, byte for byte (schemes/fp4.py, docs/FORMATS.md FP4). GPTQ rounds onto the same E2M1 grid with
the round-to-nearest scales kept (the global scale fixed first, from the whole weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_fp4 import MXFP4PackQuantized, NVFP4PackQuantized
from qconvert.formats.qarray import QArray
from qconvert.schemes.base import ClipSearch, Scheme, SearchResult
from qconvert.schemes.fp4 import (NVFP4_GROUP, check_finite, dequantize_fp4, effective_scale,
                                  nvfp4_global_scale, quantize_mxfp4, quantize_nvfp4)
from qconvert.schemes.grids import E2M1Grid
from qconvert.schemes.int4 import INT4_THRESHOLDS
from qconvert.schemes.rowwise import block_rows, quantize_rows

# The linears vLLM loads into one fused layer with one global scale: qkv_proj, gate_up_proj (an expert's w13, Mixtral's
# w1/w3), DeepSeek's fused_qkv_a_proj.
FUSED_SHARDS = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}), frozenset({"w1", "w3"}),
                frozenset({"q_a_proj", "kv_a_proj_with_mqa"}))
FP4_CLIP_GRID = tuple(round(1.0 - 0.0125 * k, 4) for k in range(21))  # 1.00 .. 0.75


def group_errors(quantize: Callable, w: np.ndarray, ratios: np.ndarray, group: int) -> np.ndarray:
    """[rows, groups] squared error of each group of `w` quantized with one clip ratio for every group."""
    w32 = np.asarray(w, np.float32)
    q = quantize(w, np.full((w.shape[0], w.shape[1] // group), ratios, np.float32))
    d = (dequantize_fp4(q) - w32).reshape(w.shape[0], -1, group)
    return np.sum(d.astype(np.float64) ** 2, axis=2)


def fp4_clip_search(quantize: Callable, w: np.ndarray, group: int,
                    grid: tuple[float, ...] = FP4_CLIP_GRID) -> SearchResult:
    """Per output row and group, the absmax ratio of `grid` (largest first) whose squared error is least."""
    errors = np.stack([group_errors(quantize, w, ratio, group) for ratio in grid])
    best = np.argmin(errors, axis=0)
    chosen = np.take_along_axis(errors, best[None], axis=0)[0]
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()), float(chosen.sum()))


class FP4Scheme(Scheme):
    """E2M1 codes with one scale per output row and group of input columns, float activations."""

    group: int
    # GPTQ on the E2M1 grid lowered the perplexity change and the KL of both real LLMs by 13 to 20 standard errors
    # against round-to-nearest, for NVFP4 and MXFP4 alike (docs/ACCURACY.md, FP4): on unless --no-gptq. AWQ on FP4 was
    # not measured: opt-in.
    default_gptq = True

    def layout_flags(self, *, act: str = "dynamic", double_quant: bool = False, group_size: int | str | None = None,
                     shapes: Mapping[str, tuple[int, int]] | None = None) -> LayoutFlags:
        """UsageError naming the first linear whose input width the scheme's group does not divide (compressed-tensors
        and its loaders take whole groups only)."""
        bad = next((m for m, (_, k) in sorted((shapes or {}).items()) if int(k) % self.group), None)
        if bad is not None:
            raise UsageError(f"--scheme {self.name} needs input widths that are multiples of {self.group}: {bad}'s is "
                             f"{shapes[bad][1]}; leave such linears float with --exclude, or use --scheme int4")
        return LayoutFlags()

    def gptq_grid(self):
        return E2M1Grid()

    def gptq_steps(self, q: QArray, flags: LayoutFlags) -> np.ndarray:
        return np.ascontiguousarray(np.repeat(effective_scale(q), q.block_size, axis=-1))

    def folder_weight(self, q: QArray) -> np.ndarray:
        return dequantize_fp4(q).astype(np.float64)

    def clip_search(self, weight: np.ndarray, flags: LayoutFlags):
        return fp4_clip_search(lambda w, ratios: self.quantize(w, flags, scale_dtype=None, clip=ratios),
                               weight, self.group)


class NVFP4A16(FP4Scheme):
    """NVFP4: E4M3 scales per group of 16 and a float32 global scale per tensor."""

    name = "nvfp4a16"
    layout = NVFP4PackQuantized()
    group = NVFP4_GROUP
    # Measured with verify's defaults on the default recipe (GPTQ): SmolLM2-135M KL 0.174, top-1 0.736, perplexity
    # x1.085, worst linear 20.9 dB; Gemma 3 270M KL 0.059, top-1 0.836, x1.055, 21.1 dB (docs/ACCURACY.md, FP4).
    thresholds = dataclasses.replace(INT4_THRESHOLDS, max_mean_kl=0.25)
    clip = ClipSearch(FP4_CLIP_GRID, "per output row and group of 16: group absmax * c before its E4M3 scale")

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None,
                 shared_absmax: float | None = None) -> QArray:
        """`shared_absmax`: the absmax of the linears a server fuses with this one (shared_absmax): the global
        scale is theirs together, as llm-compressor's fused observers give it; else the tensor's own."""
        global_scale = None if shared_absmax is None else nvfp4_global_scale(shared_absmax, np.asarray(weight).dtype)
        return quantize_nvfp4(weight, global_scale, clip=clip)

    def shared_absmax(self, modules: Sequence[str], absmax: Callable[[str], float]) -> dict[str, float]:
        """q/k/v, gate/up (an expert's too) and DeepSeek's q_a/kv_a: one global scale from their joint absmax, as
        vLLM applies one per fused layer."""
        groups: dict[tuple[str, int], list[str]] = {}
        for module in modules:
            parent, _, leaf = module.rpartition(".")
            for index, shards in enumerate(FUSED_SHARDS):
                if leaf in shards:
                    groups.setdefault((parent, index), []).append(module)
        shared = {}
        for members in groups.values():
            joint = max(absmax(m) for m in members)
            shared.update({m: joint for m in members})
        return shared

    def quantize_rows(self, read_rows, shape: tuple[int, int], dtype: np.dtype, flags: LayoutFlags,
                      shared_absmax: float | None = None) -> QArray:
        """The global scale from the whole weight's absmax (one pass over its blocks of rows; `shared_absmax`
        instead where given), then the blocks."""
        rows, cols = shape
        step = block_rows(rows, cols, np.dtype(dtype).itemsize)
        absmax = shared_absmax
        if absmax is None:
            absmax = 0.0
            for start in range(0, rows, step):
                part = np.asarray(read_rows(start, min(rows, start + step)))
                check_finite(part)
                absmax = max(absmax, float(np.abs(part.astype(np.float32)).max(initial=0.0)))
        global_scale = nvfp4_global_scale(absmax, dtype)
        joined = quantize_rows(lambda part: quantize_nvfp4(part, global_scale), read_rows, shape, dtype)
        # The blocks' zero-point slots each carry the one global scale; the whole tensor's is [1, 1].
        return dataclasses.replace(joined, zero_point=np.full((1, 1), global_scale, np.float32))


class MXFP4A16(FP4Scheme):
    """MXFP4: power-of-two (E8M0) scales per group of 32."""

    name = "mxfp4a16"
    layout = MXFP4PackQuantized()
    group = 32
    # Measured as nvfp4a16's: SmolLM2-135M KL 0.281, top-1 0.662, perplexity x1.245, worst linear 18.9 dB; Gemma 3
    # 270M KL 0.103, top-1 0.781, x1.036, 19.2 dB. Power-of-two scales lose more than NVFP4's E4M3 ones.
    thresholds = dataclasses.replace(INT4_THRESHOLDS, max_mean_kl=0.40, min_top1_agreement=0.60)
    clip = ClipSearch(FP4_CLIP_GRID, "per output row and group of 32: group absmax * c before its power-of-two scale")

    def quantize(self, weight: np.ndarray, flags: LayoutFlags, *, scale_dtype, clip=None) -> QArray:
        return quantize_mxfp4(weight, clip=clip)
