"""`--scheme nf4`: QLoRA NormalFloat-4 in blocks of 64, bitsandbytes' 4-bit serialization.

NF4 of a weight: absmax per block of 64 over the row-major flattened values, each value's code the number of
the 15 thresholds between neighbouring levels it lies strictly above (a tie lands on the lower code), as
bitsandbytes computes them. The clip search tries stored absmax = c * max|block| on a fixed grid of c and
keeps, per block, the c with the least squared error (values beyond it clip to +-1).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import UsageError
from qconvert.formats.layout_base import LayoutFlags
from qconvert.formats.layout_nf4 import BitsandbytesNF4
from qconvert.formats.packing import dequantize_double_quant, double_quantize_absmax, pack_nf4_codes
from qconvert.formats.qarray import NF4_BLOCK_SIZE, NF4_LEVELS, NF4_ZERO_CODE, QArray
from qconvert.formats.quotient import f32_quotient
from qconvert.models.module_roles import is_expert
from qconvert.schemes.base import ClipSearch, Scheme, SearchResult, Thresholds
from qconvert.schemes.grids import LevelGrid
from qconvert.schemes import rowwise
from qconvert.schemes.rowwise import (all_finite_hint, bucket, check_finite, host_weight, pad_rows,
                                      quantize_nf4_rows, x64)

# bitsandbytes' floor for the absmax of a weight's partial last block (torch's clamp(min=1e-38)).
TAIL_ABSMAX_FLOOR = np.float32(1e-38)


# Decision thresholds between neighbouring NF4 levels: a value goes to the
# number of thresholds it lies strictly above, so a tie lands on the lower code.
NF4_THRESHOLDS = ((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / np.float32(2)).astype(np.float32)


def _block_absmax(blocks: jax.Array) -> jax.Array:
    # Halving elementwise maxima: XLA's CPU reduction over a short minor axis is far
    # slower, and so is a maximum taken in bf16/fp16 (float32 max is native; exact either way).
    x = jnp.abs(blocks.astype(jnp.float32))
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = jnp.maximum(x[:, :half], x[:, half:])
    return x[:, 0]


@functools.partial(jax.jit, static_argnames=("block_size",))
def nf4_codes_and_absmax(flat: jax.Array, block_size: int = NF4_BLOCK_SIZE, clip: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """NF4 codes (uint8, one per element) of whole blocks, float32 absmax per block, and a finite hint.

    `flat` holds a whole number of blocks. `clip` (float32 [blocks], optional)
    scales each block's stored absmax (a searched ratio); values beyond it take
    the code of +-1. Call inside `x64()`.

    A block is scaled as bitsandbytes scales a whole block, by a multiply with
    float32 1/absmax, so the codes are its codes (a weight's partial last block
    is scaled apart, by nf4_tail_block).
    """
    blocks = flat.reshape(-1, block_size)
    if block_size & (block_size - 1) == 0:
        absmax = _block_absmax(blocks)
    else:
        absmax = jnp.max(jnp.abs(blocks), axis=1).astype(jnp.float32)
    if clip is not None:
        absmax = absmax * clip
    # An all-zero block normalizes to 0 (code 7, the level 0.0) instead of NaN.
    inverse = f32_quotient(jnp.float32(1.0), jnp.where(absmax == 0, 1.0, absmax).astype(jnp.float32))
    normalized = blocks.astype(jnp.float32) * inverse[:, None]
    return nf4_codes(normalized).reshape(-1), absmax, all_finite_hint(flat)


def nf4_tail_block(values: np.ndarray, clip: float | None = None) -> tuple[np.ndarray, np.float32]:
    """Codes and absmax of a weight's partial last block, as bitsandbytes computes them.

    There the values are divided (not multiplied by a reciprocal) by an absmax
    raised to at least 1e-38. In numpy: 1e-38 is subnormal, which XLA's CPU
    arithmetic flushes to zero.
    """
    values = np.asarray(values, dtype=np.float32)
    absmax = np.abs(values).max() if clip is None else np.abs(values).max() * np.float32(clip)
    absmax = np.maximum(np.float32(absmax), TAIL_ABSMAX_FLOOR)
    codes = np.searchsorted(NF4_THRESHOLDS, values / absmax, side="left").astype(np.uint8)
    return codes, absmax


def _pick(bits: list[jax.Array], table: list[float]) -> jax.Array:
    # The table entry indexed by the bits read as a binary number, most significant first.
    if not bits:
        return jnp.float32(table[0])
    half = len(table) // 2
    return jnp.where(bits[0], _pick(bits[1:], table[half:]), _pick(bits[1:], table[:half]))


def nf4_codes(normalized: jax.Array) -> jax.Array:
    """The number of NF4 thresholds each value lies strictly above (its code), as uint8.

    A branch-free binary search over the 15 sorted thresholds: four comparisons,
    each against the threshold the bits found so far select, all in one fused
    elementwise loop (cheaper than 15 comparisons, and a reduction over a
    thresholds axis does not fuse at all).
    """
    bits: list[jax.Array] = []
    for level in range(4):
        step = 8 >> level
        table = [float(NF4_THRESHOLDS[p * 2 * step + step - 1]) for p in range(1 << level)]
        bits.append(normalized > _pick(bits, table))
    return sum(bit.astype(jnp.uint8) << (3 - level) for level, bit in enumerate(bits)).astype(jnp.uint8)


@jax.jit
def pack_nf4_pairs(codes: jax.Array, valid: jax.Array) -> jax.Array:
    """uint8 codes [2k] -> bytes [k], byte = (code[2i] << 4) | code[2i+1].

    With an odd count `valid` of real codes, the low nibble after the last one is
    the code of 0.0, as bitsandbytes writes it (it pads the values with a zero).
    """
    pairs = codes.reshape(-1, 2)
    packed = (pairs[:, 0] << 4) | pairs[:, 1]
    last = jnp.minimum(valid // 2, packed.shape[0] - 1)
    return packed.at[last].set(jnp.where(valid % 2 == 1, (packed[last] & 0xF0) | NF4_ZERO_CODE, packed[last]))


def quantize_nf4(w, block_size: int = NF4_BLOCK_SIZE, *, clip=None) -> QArray:
    """NF4 of a weight: absmax per block of `block_size` over the row-major flattened values.

    `clip` (float32 [blocks], optional): per-block ratios from a scale search;
    the stored absmax is then clip * max|block|.

    The flat values go through the kernel in chunks of whole blocks (an even
    count); a tail chunk is padded with zeros to a power-of-two number of blocks,
    and the padding's codes and blocks are dropped (zeros do not change a partial
    block's absmax). Raises InvalidWeightError for NaN/Inf values.
    """
    w = host_weight(w)
    if w.size == 0:
        raise ValueError(f"NF4 quantization takes a non-empty weight, got shape {tuple(w.shape)}")
    flat = w.reshape(-1)
    n = flat.size
    unit = 2 * block_size  # whole blocks and whole bytes in every chunk
    step = max(unit, rowwise.CHUNK_ELEMENTS // unit * unit)
    packed = np.empty(-(-n // 2), np.uint8)
    absmax = np.empty(-(-n // block_size), np.float32)
    pending = []
    ratios = None if clip is None else np.asarray(clip, np.float32).reshape(-1)
    with x64():
        for start in range(0, n, step):
            part = flat[start:start + step]
            length = unit * bucket(-(-part.size // unit), step // unit)
            part_clip = None if ratios is None else pad_rows(
                ratios[start // block_size:(start + part.size + block_size - 1) // block_size], length // block_size)
            codes, part_absmax, hint = nf4_codes_and_absmax(pad_rows(part, length), block_size, part_clip)
            pending.append((start, part.size, pack_nf4_pairs(codes, np.int32(part.size)), part_absmax, hint))
        for start, count, part_packed, part_absmax, _ in pending:
            packed[start // 2:(start + count + 1) // 2] = np.asarray(part_packed)[:(count + 1) // 2]
            absmax[start // block_size:-(-(start + count) // block_size)] = (
                np.asarray(part_absmax)[:-(-count // block_size)])
        check_finite(w, [item[-1] for item in pending])
    if n % block_size:
        first = n - n % block_size
        codes, absmax[-1] = nf4_tail_block(flat[first:], None if ratios is None else ratios[-1])
        packed[first // 2:] = pack_nf4_codes(codes)
    return QArray(qvalue=packed, scale=absmax, kind="nf4", block_size=block_size, shape=w.shape, dtype=w.dtype)



NF4_CLIP_GRID = tuple(round(1.0 - 0.0125 * k, 4) for k in range(21))          # 1.00 .. 0.75



@jax.jit
def _nf4_block_errors(blocks: jax.Array, levels: jax.Array, thresholds: jax.Array,
                      grid: jax.Array) -> jax.Array:
    """[ratios, blocks] squared error of each block with stored absmax = c * max|block|."""
    absmax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)

    def one(c):
        stored = jnp.where(absmax == 0, 1.0, c * absmax)
        codes = jnp.sum(blocks[..., None] / stored[..., None] > thresholds, axis=-1)
        return jnp.sum((blocks - levels[codes] * stored) ** 2, axis=1)

    return jax.lax.map(one, grid)



def nf4_clip_search(flat: np.ndarray, block_size: int, levels: np.ndarray, thresholds: np.ndarray,
                    grid: tuple[float, ...] = NF4_CLIP_GRID) -> SearchResult:
    """Per block of `block_size` values of the flattened weight, the absmax ratio minimising the block's error.

    The last block may be partial (zero padding changes neither its max nor its error).
    """
    flat = np.asarray(flat, np.float32).reshape(-1)
    nblocks = -(-flat.size // block_size)
    padded = np.zeros(nblocks * block_size, np.float32)
    padded[: flat.size] = flat
    blocks = padded.reshape(nblocks, block_size)
    g = jnp.asarray(grid, jnp.float32)
    lv, th = jnp.asarray(levels, jnp.float32), jnp.asarray(thresholds, jnp.float32)
    # Chunks of blocks keep the [ratios, chunk, 64, 15] comparison small.
    chunk = 4096
    errors = np.concatenate([np.asarray(_nf4_block_errors(jnp.asarray(pad_rows(blocks[s:s + chunk], chunk)),
                                                          lv, th, g))[:, : min(chunk, nblocks - s)]
                             for s in range(0, nblocks, chunk)], axis=1).astype(np.float64)
    best = np.argmin(errors, axis=0)
    return SearchResult(np.asarray(grid, np.float32)[best], float(errors[0].sum()),
                        float(errors[best, np.arange(nblocks)].sum()))



class NF4(Scheme):
    """16 NormalFloat levels times each block's absmax; blocks of 64 run over the flattened weight."""

    name = "nf4"
    layout = BitsandbytesNF4()
    vllm_loads = False
    writes_kv_cache_scheme = False
    takes_double_quant = True
    clip = ClipSearch(NF4_CLIP_GRID, "per block of 64: stored absmax = c * max|block|, values beyond it clip to +-1")
    thresholds = Thresholds(
        min_layer_sqnr_db=15.0, min_layer_cosine=0.98, max_mean_kl=0.10,
        min_top1_agreement=0.70, max_perplexity_ratio=1.25, min_pooled_cosine=0.93,
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
