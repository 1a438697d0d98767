"""One GPTQ group's rows split over every device of the mesh, and which groups are split.

A weight's rows are independent once U (the Cholesky factor of the damped inverse Hessian) and the column order
are known: GPTQ feeds a column's error only along its own row. So the group whose solve a layer would wait for
(down_proj's, input 14,336 wide on Llama-3-8B) is not given to one device: every process factors its Hessian
once, on its first device, and hands U to its other devices; each device of every process rounds one block of
the stacked rows; every process receives every block. The rows a device rounds see the same float32 operations
as on one device (each row's sums run over columns, never over rows), so the codes are one device's whatever
the mesh, where each block's products take the kernel the whole matrix's take (MIN_ROWS_A_DEVICE).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from qconvert.cluster.share import share
from qconvert.methods.gptq_core import round_columns
from qconvert.schemes.grids import FloatGrid, IntegerGrid, RoundingGrid

# Fewer rows a device and XLA's CPU dot takes another kernel, whose sums round otherwise (docs/SCALING.md).
MIN_ROWS_A_DEVICE = 64


def split_groups(costs: Sequence[float], rows: Sequence[int], devices: int) -> list[bool]:
    """Which groups are split by rows over every device, the others staying whole on the devices `owners` gives
    them: the largest first, a group is split while, kept whole, it would cost its device more than an even
    share of what is left whole (its own cost included), so that no device holds the layer up with one group;
    a group needs MIN_ROWS_A_DEVICE rows a device. One device: none. The same answer on every process."""
    split = [False] * len(costs)
    if devices <= 1:
        return split
    left = sum(costs)
    for g in sorted(range(len(costs)), key=lambda g: (-costs[g], g)):
        if costs[g] > left / devices and rows[g] >= MIN_ROWS_A_DEVICE * devices:
            split[g] = True
            left -= costs[g]
    return split


def row_blocks(rows: int, devices: int) -> list[slice]:
    """`rows` cut into `devices` contiguous blocks, the first ones a row longer where they do not divide."""
    base, extra = divmod(rows, devices)
    bounds = np.cumsum([0] + [base + (d < extra) for d in range(devices)])
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def round_rows(stacked: np.ndarray, steps: np.ndarray, offsets: np.ndarray | None, factor: tuple, *,
               grid: RoundingGrid, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's (codes, values) of a group's stacked rows with U, perm and dead (`factor`, hessian_factor's), each
    device of every process rounding one block of rows; every process returns the whole group's."""
    devices = jax.devices()
    blocks = row_blocks(stacked.shape[0], len(devices))
    launched = {}
    for d, device in enumerate(devices):  # dispatched to every local device before any result is read
        if device.process_index == jax.process_index():
            launched[d] = _launch(device, blocks[d], stacked, steps, offsets, factor, grid, block_size)
    arrays = {}
    for d, (codes, values) in launched.items():
        arrays.update({f"{d}:codes": np.asarray(codes).astype(_code_dtype(grid)), f"{d}:values": np.asarray(values)})
    gathered = {}
    for their_arrays, _ in share(arrays, None):
        gathered.update(their_arrays)
    codes, values = ([gathered[f"{d}:{name}"] for d in range(len(devices))] for name in ("codes", "values"))
    return np.concatenate(codes).astype(stacked.dtype), np.concatenate(values)


def _launch(device, rows: slice, stacked, steps, offsets, factor, grid, block_size):
    """One device's block of rows: its codes and values, dispatched (not waited for)."""
    def put(array):
        return None if array is None else jax.device_put(array, device)

    return round_columns(put(stacked[rows]), put(steps[rows]), *(put(a) for a in factor), grid=grid,
                         block_size=block_size, offsets=None if offsets is None else put(offsets[rows]))


def _code_dtype(grid: RoundingGrid) -> np.dtype:
    """The narrowest dtype a grid's codes travel in exactly: int8 for integers in its range and for level
    indices, float32 for float8 values (whose -0 is a code of its own)."""
    if isinstance(grid, FloatGrid) or isinstance(grid, IntegerGrid) and not -128 <= grid.qmin <= grid.qmax <= 127:
        return np.dtype(np.float32)
    return np.dtype(np.int8)
