"""Shape ops that keep a QArray packed: transpose, reshape and slice_in_dim, mirroring jax.lax.

What stays packed (no float copy is ever made):
  int8  transpose with any permutation (payload and scale move together);
        reshape when every group of merged/split axes is either wholly shared
        by the scale (size 1) or wholly per-element; slicing any axis.
  nf4   reshape to any shape of the same size (the codes are stored flat in
        row-major order, so the blocks do not move); slicing whole rows of the
        first axis when the cut falls on a block boundary.
  int4  as int8 on every axis but the last, which holds the scale groups and
        stays last and whole: transposes and reshapes that keep it, slices of
        it on group boundaries, stacking on any new axis but the last.

Anything else would have to re-block the codes, which needs the float values:
these functions then raise PackedLayoutError instead of silently
materializing; `q.dequantize()` is the explicit way, at a cost of
size * itemsize bytes of float memory (4 bytes per element for float32, 8x an
int8 payload and 8x-16x an NF4 one), after which the jax.lax op applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qconvert.formats.errors import QConvertError
from qconvert.formats.qarray import QArray
from qconvert.ops import kernel_calls
from qconvert.ops.dispatch import operand_shape


class PackedLayoutError(QConvertError):
    """A shape op that would split a QArray's quantization blocks; dequantize first."""

    exit_code = 2


def _replace(q: QArray, qvalue, scale, zero_point, shape) -> QArray:
    return QArray(qvalue, scale, zero_point, kind=q.kind, block_size=q.block_size, shape=shape, dtype=q.dtype)


def transpose(operand, permutation: Sequence[int]):
    """jax.lax.transpose; an int8 QArray stays packed, an int4 one when its last axis stays last, an NF4 one
    only for the identity."""
    if not isinstance(operand, QArray):
        return jax.lax.transpose(operand, tuple(permutation))
    perm = tuple(int(p) for p in permutation)
    shape = operand_shape(operand)
    if sorted(perm) != list(range(len(shape))):
        raise PackedLayoutError(f"permutation {perm} is not a permutation of the {len(shape)} axes of {shape}")
    if operand.kind.flat_blocks:
        if perm == tuple(range(len(shape))):
            return operand
        raise PackedLayoutError(
            f"transposing an NF4 QArray {shape} would re-block its codes; call .dequantize() first "
            f"(a float copy of {math.prod(shape)} elements)"
        )
    if operand.kind.column_groups and perm[-1] != len(shape) - 1:
        raise PackedLayoutError(
            f"transposing an int4 QArray {shape} by {perm} would move its grouped last axis; call .dequantize() first"
        )
    zero_point = None if operand.zero_point is None else jnp.transpose(operand.zero_point, perm)
    new_shape = tuple(shape[p] for p in perm)
    return _replace(operand, jnp.transpose(operand.qvalue, perm), jnp.transpose(operand.scale, perm),
                    zero_point, new_shape)


def _segments(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of old and new axes whose sizes multiply to the same number."""
    segments, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        old_run, new_run, old_size, new_size = [], [], 1, 1
        if i < len(old):
            old_run, old_size, i = [i], old[i], i + 1
        if j < len(new):
            new_run, new_size, j = [j], new[j], j + 1
        while old_size != new_size:
            if old_size < new_size:
                old_run.append(i)
                old_size, i = old_size * old[i], i + 1
            else:
                new_run.append(j)
                new_size, j = new_size * new[j], j + 1
        segments.append((old_run, new_run))
    return segments


def _reshape_scale(scale, old: Sequence[int], new: Sequence[int]):
    """The scale for the reshaped payload, or None when a group mixes shared and per-element axes."""
    if math.prod(old) == 0:
        return jnp.ones((1,) * len(new), scale.dtype)  # no values, so any scale describes them
    new_scale_shape = []
    for old_run, new_run in _segments(old, new):
        shared = all(scale.shape[d] == 1 for d in old_run)
        full = all(scale.shape[d] == old[d] for d in old_run)
        if shared:
            new_scale_shape += [1] * len(new_run)
        elif full:
            new_scale_shape += [new[d] for d in new_run]
        else:
            return None
    return jnp.reshape(scale, tuple(new_scale_shape))


def reshape(operand, new_sizes: Sequence[int]):
    """jax.lax.reshape; a QArray stays packed when the reshape moves whole quantization blocks."""
    if not isinstance(operand, QArray):
        return jax.lax.reshape(operand, tuple(new_sizes))
    old = operand_shape(operand)
    new = tuple(int(d) for d in new_sizes)
    if math.prod(new) != math.prod(old):
        raise PackedLayoutError(f"cannot reshape a QArray of shape {old} to {new}: the sizes differ")
    if operand.kind.flat_blocks:
        return _replace(operand, operand.qvalue, operand.scale, operand.zero_point, new)
    old_blocks, new_blocks = old, new
    if operand.kind.column_groups:
        if not old or not new or new[-1] != old[-1]:
            raise PackedLayoutError(f"reshaping int4 QArray {old} to {new} would change its grouped last axis; "
                                    "keep it, or call .dequantize() first")
        # Seen per scale group, the last axis is a per-element axis of as many groups as the scale has.
        groups = operand.scale.shape[-1]
        old_blocks, new_blocks = old[:-1] + (groups,), new[:-1] + (groups,)
    scale = _reshape_scale(operand.scale, old_blocks, new_blocks)
    zero_point = operand.zero_point
    if zero_point is not None:
        zero_point = _reshape_scale(zero_point, old_blocks, new_blocks)
    if scale is None or (operand.zero_point is not None and zero_point is None):
        raise PackedLayoutError(
            f"reshaping {operand.kind} QArray {old} to {new} would merge axes where the scale "
            f"{tuple(operand.scale.shape)} is shared with axes where it is not; call .dequantize() first"
        )
    return _replace(operand, jnp.reshape(operand.qvalue, new), scale, zero_point, new)


def _slice_axis(x, start: int, limit: int, stride: int, axis: int):
    if x.shape[axis] == 1:
        return x
    return jax.lax.slice_in_dim(x, start, limit, stride, axis)


def slice_in_dim(operand, start_index: int, limit_index: int, stride: int = 1, axis: int = 0):
    """jax.lax.slice_in_dim; whole channels of an int8 QArray (int4: whole groups of its last axis), whole
    blocks of rows of an NF4 one."""
    if not isinstance(operand, QArray):
        return jax.lax.slice_in_dim(operand, start_index, limit_index, stride, axis)
    shape = operand_shape(operand)
    axis = axis % len(shape)
    start, limit, _ = slice(start_index, limit_index).indices(shape[axis])
    new_shape = shape[:axis] + (len(range(start, limit, stride)),) + shape[axis + 1:]
    if operand.kind.column_groups and axis == len(shape) - 1:
        return _slice_int4_groups(operand, start, limit, stride, new_shape)
    if operand.kind.integer:
        zero_point = operand.zero_point
        if zero_point is not None:
            zero_point = _slice_axis(zero_point, start, limit, stride, axis)
        return _replace(operand, jax.lax.slice_in_dim(operand.qvalue, start, limit, stride, axis),
                        _slice_axis(operand.scale, start, limit, stride, axis), zero_point, new_shape)
    row = math.prod(shape[1:])
    first, end = start * row, limit * row
    block = operand.block_size
    on_blocks = first % block == 0 and (end % block == 0 or limit == shape[0])
    if axis != 0 or stride != 1 or not on_blocks:
        raise PackedLayoutError(
            f"slicing NF4 QArray {shape} at [{start}:{limit}:{stride}] on axis {axis} would cut its "
            f"{block}-element blocks; slice whole blocks of rows of axis 0, or call .dequantize() first"
        )
    qvalue = operand.qvalue[first // 2:(end + 1) // 2]
    scale = operand.scale[first // block:-(-end // block)]
    return _replace(operand, qvalue, scale, operand.zero_point, new_shape)


def _slice_int4_groups(operand: QArray, start: int, limit: int, stride: int, new_shape) -> QArray:
    """Whole scale groups of an int4 QArray's last axis (any columns for a per-channel scale)."""
    group = operand.block_size
    axis = len(new_shape) - 1
    if group is None:
        parts = [operand.scale, operand.zero_point]
    elif stride != 1 or start % group or limit % group:
        raise PackedLayoutError(
            f"slicing int4 QArray {operand.shape} at [{start}:{limit}:{stride}] on its last axis would cut its "
            f"groups of {group}; slice whole groups, or call .dequantize() first"
        )
    else:
        parts = [None if a is None else _slice_axis(a, start // group, limit // group, 1, axis)
                 for a in (operand.scale, operand.zero_point)]
    qvalue = jax.lax.slice_in_dim(operand.qvalue, start, limit, stride, axis)
    return _replace(operand, qvalue, parts[0], parts[1], new_shape)


def stack(operands: Sequence, axis: int = 0):
    """jax.numpy.stack for QArrays of one kind, shape and dtype; the result stays packed.

    int8: payloads and scales stack along `axis` (int4: any axis but a new last
    one, which would move the grouped axis). NF4 (axis 0 only): the flat
    codes and absmax of each operand are concatenated, which is the packing of
    the stacked tensor when every operand fills whole blocks. Plain arrays go
    to jnp.stack.
    """
    if any(kernel_calls.is_prepared(x) for x in operands):
        # The grouped (MoE) path stacks experts' QArrays; prepared operands are per dense weight.
        raise kernel_calls.PreparedWeightError(f"ops.stack: {kernel_calls.PREPARED_ONLY_LINEAR}")
    if not any(isinstance(x, QArray) for x in operands):
        return jnp.stack(operands, axis=axis)
    first = operands[0]
    same = all(isinstance(x, QArray) and (x.kind, x.shape, x.dtype, x.block_size) ==
               (first.kind, first.shape, first.dtype, first.block_size) for x in operands)
    if not same:
        raise PackedLayoutError("stack takes QArrays of one kind, shape and dtype; dequantize the others first")
    shape = operand_shape(first)
    axis = axis % (len(shape) + 1)
    new_shape = shape[:axis] + (len(operands),) + shape[axis:]
    if first.kind.column_groups and axis == len(shape):
        raise PackedLayoutError(f"stacking int4 QArrays {shape} on a new last axis would move their grouped axis; "
                                "stack on an earlier axis, or call .dequantize() first")
    if first.kind.integer:
        zero_points = None
        if first.zero_point is not None:
            zero_points = jnp.stack([x.zero_point for x in operands], axis=axis)
        return _replace(first, jnp.stack([x.qvalue for x in operands], axis=axis),
                        jnp.stack([x.scale for x in operands], axis=axis), zero_points, new_shape)
    if axis != 0 or first.size % first.block_size or first.size % 2:
        raise PackedLayoutError(
            f"stacking NF4 QArrays {shape} on axis {axis} would re-block their codes; stack on axis 0 "
            f"tensors whose size is a multiple of {first.block_size}, or call .dequantize() first"
        )
    return _replace(first, jnp.concatenate([x.qvalue for x in operands]),
                    jnp.concatenate([x.scale for x in operands]), None, new_shape)
