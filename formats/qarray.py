"""QArray: the one quantized-tensor type that stores, loads, multiplies and verifies.

A QArray carries an integer payload, its scales, an optional zero point, the
quantization kind, the block size, and the original (logical) shape and dtype.

A kind is a QKind: a type object that answers what code that handles QArrays
needs to know (its bits, whether codes index a level table, whether scales run
over blocks of the flattened tensor or over groups of the last axis), so no
code outside this module and the layouts compares kind names. Its name is its
string value (a QKind is a str), which is what files and reports show.

Kinds:
  "int8"  qvalue int8 with the logical shape ([out, in] for a linear); scale has
          the same rank as qvalue, with size 1 on the axes it is shared along
          ([out, 1] per output channel, [1, 1] per tensor). value = qvalue * scale.
  "nf4"   qvalue uint8 [ceil(n / 2)]: the row-major flattened codes, two per byte,
          the earlier element in the high nibble; scale float32 [ceil(n / block_size)]
          holds each block's absmax. value = NF4_LEVELS[code] * absmax[block].
  "int4"  qvalue int8 codes in [-8, 7] at the logical shape ([out, in] for a linear, [G, out, in]
          for stacked experts); scale has the same rank, one value per output channel and group of
          `block_size` consecutive input columns ([out, in / block_size]; [out, 1] per channel, when
          block_size is None). value = qvalue * scale[..., col // block_size]. Nibble packing
          belongs to the layouts and to the kernels' operand preparation. An asymmetric int4 QArray also
          has zero_point int8 [out, in / block_size] in [-8, 7]: value = (qvalue - zero) * scale.
  "fp8"   qvalue float8_e4m3fn codes at the logical shape ([out, in]; [G, out, in] for stacked experts);
          scale float [out, 1] per output channel ([G, out, 1]). value = float(qvalue) * scale.
  "fp4"   qvalue uint8 E2M1 codes (0..15: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6) at the
          logical shape [out, in]; scale float32 [out, in / block_size], each group's scale (NVFP4: an E4M3
          value; MXFP4: a power of two). NVFP4's second-level scale, one float32 per tensor, rides in the
          zero_point slot as [1, 1] (a float kind has no zero point; the slot keeps it beside the codes
          wherever a QArray's leaves go): value = FP4_LEVELS[code] * (scale / zero_point), the quotient in
          float32, as compressed-tensors divides it; without it value = FP4_LEVELS[code] * scale.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

# The 16 NormalFloat-4 levels of QLoRA / bitsandbytes, code 0..15.
NF4_LEVELS = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
        0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0,
    ],
    dtype=np.float32,
)


# The 16 E2M1 values by 4-bit code: bit 3 the sign, bits 0-2 the magnitude's index (code 8 is -0.0).
FP4_LEVELS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)


class QKind(str):
    """A quantization kind: its name (the str value) and the properties code branches on."""

    bits: int
    float_codes: bool
    levels: np.ndarray | None
    flat_blocks: bool
    column_groups: bool

    def __new__(cls, name: str, *, bits: int, levels: np.ndarray | None = None, flat_blocks: bool = False,
                column_groups: bool = False, float_codes: bool = False):
        kind = super().__new__(cls, name)
        kind.bits = bits
        kind.float_codes = float_codes  # codes are floats (float8_e4m3fn), not integers
        kind.levels = levels  # codes index this float table (NF4) instead of being the integers themselves
        kind.flat_blocks = flat_blocks  # codes packed over the flattened tensor, one scale per block of it
        kind.column_groups = column_groups  # one scale per group of `block_size` last-axis columns
        return kind

    def __reduce__(self):
        # Pickled and copied as its name, which finds the one QKind of that name again.
        return (kind_named, (str(self),))

    @property
    def integer(self) -> bool:
        """Whether each code is the value the scale multiplies (int8, int4; fp8's float codes too), not a
        table index."""
        return self.levels is None

    @property
    def int8(self) -> bool:
        """Whether codes are int8 integers with one scale per output channel or tensor (W8A16, W8A8)."""
        return self.bits == 8 and not self.float_codes

    @property
    def channel_scaled(self) -> bool:
        """Whether codes are 8-bit values (int8 integers or fp8 floats), each exact in every float dtype, with
        one scale per output channel that factors out of a matmul's sum (int8, fp8)."""
        return self.bits == 8

    @property
    def packs_nibbles(self) -> bool:
        """Whether two codes share a byte in the kernels' operands (4-bit kinds)."""
        return self.bits == 4


INT8 = QKind("int8", bits=8)
NF4 = QKind("nf4", bits=4, levels=NF4_LEVELS, flat_blocks=True)
INT4 = QKind("int4", bits=4, column_groups=True)
FP8 = QKind("fp8", bits=8, float_codes=True)
FP4 = QKind("fp4", bits=4, levels=FP4_LEVELS)
KINDS = {kind: kind for kind in (INT8, NF4, INT4, FP8, FP4)}  # name -> QKind (a QKind is its own name)


def kind_named(name: str) -> QKind:
    """The QKind called `name` (ValueError for a name no kind has)."""
    if name not in KINDS:
        raise ValueError(f"unknown QArray kind {name!r}; expected one of {tuple(KINDS)}")
    return KINDS[name]
# The largest int8 code a symmetric quantizer uses: codes lie in [-127, 127], so
# the scale is absmax / 127 and -128 is never written (weights and activations alike).
INT8_QMAX = 127
# The int4 code range of a symmetric quantizer (compressed-tensors' uint4b8 less its offset of 8).
INT4_QMIN, INT4_QMAX = -8, 7
# E4M3's largest finite value: fp8 scales are absmax / 448 and codes saturate at +-448.
FP8_E4M3_MAX = 448.0
# The fp8 code dtype (OCP E4M3 with no infinities, as compressed-tensors and vLLM store it).
FP8_DTYPE = jnp.float8_e4m3fn
# Elements per NF4 block (QLoRA, bitsandbytes): each block of the flattened weight has one absmax.
NF4_BLOCK_SIZE = 64
# The code of the level 0.0: the low nibble after an odd count of codes (bitsandbytes pads with a zero value).
NF4_ZERO_CODE = 7


@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized tensor; a JAX pytree whose leaves are qvalue, scale and zero_point."""

    qvalue: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    zero_point: jax.Array | np.ndarray | None = None
    kind: QKind = INT8
    block_size: int | None = None
    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "kind", kind_named(self.kind))  # a name given is taken as its QKind
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", str(jnp.dtype(self.dtype)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored payload, scales and zero point."""
        leaves = [self.qvalue, self.scale] + ([self.zero_point] if self.zero_point is not None else [])
        return int(sum(np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape) for leaf in leaves))

    def dequantize(self, dtype=None) -> jax.Array:
        """The float tensor this QArray stands for, in `dtype` (default: the original dtype)."""
        return dequantize(self, dtype)


jax.tree_util.register_dataclass(
    QArray,
    data_fields=["qvalue", "scale", "zero_point"],
    meta_fields=["kind", "block_size", "shape", "dtype"],
)


def unpack_nf4_codes(packed: jax.Array, n: int) -> jax.Array:
    """uint8 [ceil(n/2)] -> int32 codes [n]; the earlier element sits in the high nibble."""
    packed = jnp.asarray(packed).reshape(-1).astype(jnp.int32)
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(-1)
    return codes[:n]


def group_scale(q: QArray) -> jax.Array:
    """The float32 scale broadcast to q's logical shape: each group's scale repeated over its columns."""
    return group_columns(q.scale, q)


def group_columns(values, q: QArray) -> jax.Array:
    """float32 per-group values (a scale or a zero point, [..., groups]) broadcast to q's logical shape."""
    values = jnp.asarray(values).astype(jnp.float32)
    groups = values.shape[-1]
    if groups not in (1, q.shape[-1]):
        values = jnp.repeat(values, q.shape[-1] // groups, axis=-1)
    return jnp.broadcast_to(values, q.shape)


def fp4_group_scale(q: QArray) -> jax.Array:
    """An fp4 QArray's float32 scale broadcast to its logical shape: the group scale, divided by the second-level
    scale where there is one (NVFP4), as compressed-tensors divides it (float32)."""
    scale = jnp.asarray(q.scale).astype(jnp.float32)
    if q.zero_point is not None:
        scale = scale / jnp.asarray(q.zero_point).astype(jnp.float32)
    return group_columns(scale, q)


def dequantize(q: QArray, dtype=None) -> jax.Array:
    """Materialize a QArray as a float array (computed in float32, cast at the end)."""
    out_dtype = jnp.dtype(dtype) if dtype is not None else jnp.dtype(q.dtype)
    if q.kind.integer:
        values = jnp.asarray(q.qvalue).astype(jnp.float32)
        if q.zero_point is not None:
            values = values - group_columns(q.zero_point, q)
        return (values * group_scale(q)).astype(out_dtype)
    if q.kind == FP4:
        return (jnp.asarray(FP4_LEVELS)[jnp.asarray(q.qvalue).astype(jnp.int32)] * fp4_group_scale(q)).astype(out_dtype)
    n = q.size
    codes = unpack_nf4_codes(q.qvalue, n)
    levels = jnp.asarray(NF4_LEVELS)[codes]
    absmax = jnp.repeat(jnp.asarray(q.scale, jnp.float32), q.block_size)[:n]
    return (levels * absmax).reshape(q.shape).astype(out_dtype)


def is_prepared(x) -> bool:
    """Whether x is a kernels PreparedWeight (a weight laid out once for its kernel), asked without importing the
    kernels, which sit above this layer: none exists before they load."""
    prepared = sys.modules.get("qconvert.kernels.prepared")
    return prepared is not None and isinstance(x, prepared.PreparedWeight)
