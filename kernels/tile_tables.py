"""The tile tables (one per backend and M regime) and how a matmul problem's tiling is chosen from them and
checked: the K tile that holds whole NF4 blocks and int4 groups, the alignment each backend needs, and the
grid a tiling gives."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qconvert.formats.qarray import NF4_BLOCK_SIZE
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.tiles import Tiling, int4_packed, round_up

if TYPE_CHECKING:
    from qconvert.kernels.plan import KernelProblem


def decodes_nf4(problem: KernelProblem) -> bool:
    """Whether the kernel for the problem decodes NF4 weights (which constrains its K tiling)."""
    return problem.op == "nf4_matmul" or (problem.op == "grouped_matmul" and problem.rhs_kind.flat_blocks)


def decodes_int4(problem: KernelProblem) -> bool:
    """Whether the kernel for the problem decodes int4 weights, or FP4 ones packed as int4 (its K tiles hold whole
    scale groups)."""
    return (problem.op in ("int4_weight_matmul", "fp4_weight_matmul")
            or (problem.op == "grouped_matmul" and int4_packed(problem.rhs_kind)))


def _gpu_k_align(problem: KernelProblem) -> int:
    """The smallest K tile of a Triton dot: 32 for fp8 operands (an fp8 MMA step), 16 otherwise."""
    return 32 if problem.op == "fp8_matmul" else 16


def _int4_k_align(problem: KernelProblem, backend: str) -> int:
    """The int4 K tile's alignment: whole groups, and (Mosaic) whole 128-byte lane widths of packed codes;
    Triton's dot needs a contraction of at least 16 bytes."""
    group = problem.group_size or 1
    return max(256, group) if backend == "tpu" else max(32, group)


def _int4_k_tile(problem: KernelProblem, backend: str) -> int:
    """The K tile of an int4 kernel (dense, or grouped experts, which step K as the dense kernel does)."""
    align = _int4_k_align(problem, backend)
    tk_max = max(TILE_TABLES[(backend, regime(problem))]["int4_weight_matmul"].tk, align)
    return _k_tile(problem.k, tk_max, align, powers_of_two=backend == "gpu")


# Tile tables: (tm, tk, tn) per backend, per M regime and per operation. Decode
# (M <= DECODE_MAX_M rows: one token per sequence) is memory-bound: the weight must
# stream from memory exactly once, so the row tile covers every row and the N axis
# is cut into many narrow blocks (one program each) that together read each weight
# byte once; K steps are long so each program issues few, wide loads. Prefill
# (more rows) is compute-bound: square-ish tiles feed the matrix units, and each K
# step decodes its weight tile once for all tm rows. tm is an upper bound (a
# smaller M takes the smallest aligned tile that holds it); tk and tn are upper
# bounds clamped to the padded K and N. int4 steps K by whole scale groups (packed
# two codes per byte, so a tk of 256 reads 128 bytes of each weight row); on Mosaic
# each K tile's scales are one block as wide as their array, so tk is not tied to
# the whole K as NF4's is. Grouped int4 experts step K as the dense int4 kernel. FP4 (E2M1 codes packed as
# int4's) takes int4's tiles, dense and grouped alike.
# FP8 tiles as int8 (one byte per code): Triton's fp8 dot takes a K of 32 or more,
# and on Mosaic fp8 rows pack four to a sublane as int8 rows do.
DECODE_MAX_M = 16
# Operations whose lhs rows are one-byte codes (int8, fp8): Mosaic packs 32 such rows per (sublane) tile.
BYTE_ROW_OPS = ("int8_matmul", "fp8_matmul")
NF4_TPU_MAX_TK = 8192
REGIMES = ("decode", "prefill")
TILE_TABLES: dict[tuple[str, str], dict[str, Tiling]] = {
    # Triton: power-of-two tiles >= 16. NF4 steps K by whole 64-blocks, several at
    # a time (tk 256 = four blocks = 128 bytes of each weight row per step).
    ("gpu", "decode"): {
        "int8_matmul": Tiling(16, 256, 32),
        "fp8_matmul": Tiling(16, 256, 32),
        "int8_weight_matmul": Tiling(16, 128, 32),
        "nf4_matmul": Tiling(16, 256, 32),
        "int4_weight_matmul": Tiling(16, 256, 32),
        "fp4_weight_matmul": Tiling(16, 256, 32),
        "grouped_matmul": Tiling(16, 128, 32),
        "transposed_grouped_matmul": Tiling(16, 64, 64),
    },
    ("gpu", "prefill"): {
        "int8_matmul": Tiling(128, 128, 128),
        "fp8_matmul": Tiling(128, 128, 128),
        "int8_weight_matmul": Tiling(128, 64, 128),
        "nf4_matmul": Tiling(128, 128, 128),
        "int4_weight_matmul": Tiling(128, 128, 128),
        "fp4_weight_matmul": Tiling(128, 128, 128),
        "grouped_matmul": Tiling(64, 64, 128),
        "transposed_grouped_matmul": Tiling(64, 64, 128),
    },
    # Mosaic: (8, 128) vreg tiling ((32, 128) for int8 and fp8 rows); double-buffered tiles
    # stay far below VMEM. NF4's K tile is the whole padded K (up to 8192) so its
    # per-64-block absmax tile [tn, tk/64] is a full-width block.
    ("tpu", "decode"): {
        "int8_matmul": Tiling(32, 1024, 512),
        "fp8_matmul": Tiling(32, 1024, 512),
        "int8_weight_matmul": Tiling(16, 1024, 512),
        "nf4_matmul": Tiling(16, NF4_TPU_MAX_TK, 256),
        "int4_weight_matmul": Tiling(16, 4096, 256),
        "fp4_weight_matmul": Tiling(16, 4096, 256),
        "grouped_matmul": Tiling(16, 512, 256),
        "transposed_grouped_matmul": Tiling(256, 256, 256),
    },
    ("tpu", "prefill"): {
        "int8_matmul": Tiling(256, 512, 256),
        "fp8_matmul": Tiling(256, 512, 256),
        "int8_weight_matmul": Tiling(256, 512, 256),
        "nf4_matmul": Tiling(256, NF4_TPU_MAX_TK, 256),
        "int4_weight_matmul": Tiling(256, 2048, 256),
        "fp4_weight_matmul": Tiling(256, 2048, 256),
        "grouped_matmul": Tiling(256, 512, 256),
        "transposed_grouped_matmul": Tiling(256, 256, 256),
    },
}


def regime(problem: KernelProblem) -> str:
    """'decode' for a few rows (memory-bound), 'prefill' otherwise; the weight-gradient form is always prefill."""
    if problem.op == "transposed_grouped_matmul":
        return "prefill"
    return "decode" if problem.m <= DECODE_MAX_M else "prefill"


def table_name(backend: str, problem: KernelProblem) -> str:
    """The name of the tile table a backend uses for a problem, e.g. 'gpu/decode'."""
    return f"{backend}/{regime(problem)}"


def _power_of_two_at_least(value: int, floor: int = 16) -> int:
    size = floor
    while size < value:
        size *= 2
    return size


def _k_tile(k: int, tk_max: int, align: int, powers_of_two: bool) -> int:
    """The K tile for K: the largest allowed tile <= tk_max that divides the aligned K, so the weight
    needs no K padding, unless that takes over 4x the fewest steps; then an even split of the fewest."""
    k_aligned = round_up(k, align)
    if powers_of_two:
        sizes = [align << i for i in range(16) if align << i <= tk_max]
    else:
        sizes = list(range(align, tk_max + 1, align))
    fewest = -(-k_aligned // max(sizes))
    dividing = [t for t in sizes if k_aligned % t == 0]
    if dividing and k_aligned // max(dividing) <= 4 * fewest:
        return max(dividing)
    even = round_up(-(-k_aligned // fewest), align)
    return _power_of_two_at_least(even, align) if powers_of_two else even


def default_tiling(problem: KernelProblem, backend: str) -> Tiling:
    """The tiling a backend ('tpu' or 'gpu') uses for a problem: its tile table's entry, fitted to the sizes."""
    m, k, n, op = problem.m, problem.k, problem.n, problem.op
    table = TILE_TABLES[(backend, regime(problem))]
    entry = table[op]
    nf4, int4 = decodes_nf4(problem), decodes_int4(problem)
    if backend == "gpu":
        if op == "transposed_grouped_matmul":
            # M is the contraction here, walked in row chunks; the output tile is tk x tn.
            return Tiling(min(entry.tm, _power_of_two_at_least(m)), entry.tk,
                          min(entry.tn, _power_of_two_at_least(n, 64)))
        # Grouped NF4 experts step K as the dense NF4 kernel does.
        tk_max = table["nf4_matmul"].tk if nf4 else entry.tk
        if int4:
            tk = _int4_k_tile(problem, backend)
        else:
            tk = _k_tile(k, tk_max, NF4_BLOCK_SIZE if nf4 else _gpu_k_align(problem), powers_of_two=True)
        return Tiling(min(entry.tm, _power_of_two_at_least(m)), tk, min(entry.tn, _power_of_two_at_least(n)))
    if op == "transposed_grouped_matmul":
        # There K is the output rows and M the contraction; both are lane/sublane dims.
        return Tiling(min(entry.tm, round_up(m, 128)), min(entry.tk, round_up(k, 16)),
                      min(entry.tn, round_up(n, 128)))
    row_align = 32 if op in BYTE_ROW_OPS else 16
    tm = min(entry.tm, round_up(m, row_align))
    tn = min(entry.tn, round_up(n, 128))
    if nf4:
        # The whole padded K in one tile, or tiles of 8192: the absmax tile [tn, tk/64]
        # must span its array's full width or a multiple of 128 lanes.
        kp = round_up(k, 256)
        return Tiling(tm, min(kp, NF4_TPU_MAX_TK), tn)
    if int4:
        return Tiling(tm, _int4_k_tile(problem, backend), tn)
    return Tiling(tm, _k_tile(k, entry.tk, 128, powers_of_two=False), tn)


def check_tiling(problem: KernelProblem, backend: str, tiling: Tiling) -> None:
    """Raise KernelArgumentError when a requested tiling breaks the backend's layout rules."""
    nf4, int4 = decodes_nf4(problem), decodes_int4(problem)
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    if min(tm, tk, tn) <= 0:
        raise KernelArgumentError(f"tile sizes must be positive, got {tiling}")
    if int4 and tk % _int4_k_align(problem, backend):
        what = "whole 128-byte lane widths of packed codes" if backend == "tpu" else "a dot of 16 bytes or more"
        raise KernelArgumentError(f"{backend.upper()} int4 tiles need tk to be a multiple of "
                                  f"{_int4_k_align(problem, backend)} (whole scale groups and {what}), got {tk}")
    if backend == "gpu":
        if any(t < 16 or t & (t - 1) for t in (tm, tk, tn)):
            raise KernelArgumentError(f"GPU tiles must be powers of two >= 16, got {tiling}")
        if tk < _gpu_k_align(problem):
            raise KernelArgumentError(f"the GPU fp8 dot needs tk >= {_gpu_k_align(problem)}, got {tk}")
        if nf4 and tk % NF4_BLOCK_SIZE:
            raise KernelArgumentError(f"the GPU NF4 kernel steps K by whole 64-blocks; tk must be a multiple of "
                                      f"{NF4_BLOCK_SIZE}, got {tk}")
        return
    if problem.op == "transposed_grouped_matmul":
        # lhs [K, M] tiles are (tk, tm): M on lanes, K on sublanes.
        if tm % 128 or tk % 8 or tn % 128:
            raise KernelArgumentError(f"TPU transposed_grouped_matmul tiles need tm % 128, tk % 8 and tn % 128 "
                                      f"to be 0, got {tiling}")
        return
    row_align = 32 if problem.op in BYTE_ROW_OPS else 8
    if tm % row_align or tn % 128:
        raise KernelArgumentError(f"TPU tiles need tm % {row_align} == 0 and tn % 128 == 0, got {tiling}")
    if nf4:
        full_k = round_up(problem.k, 256)
        if tk % 256 or (tk != full_k and tk % NF4_TPU_MAX_TK):
            raise KernelArgumentError(f"TPU NF4 tiles need tk = the padded K ({full_k}) or a multiple of 8192, "
                                      f"got {tk}")
    elif tk % 128:
        raise KernelArgumentError(f"TPU tiles need tk % 128 == 0, got {tiling}")


def grid_steps(problem: KernelProblem, tiling: Tiling) -> int:
    """How many grid steps (tiles) a tiled kernel runs for the problem (an upper bound for grouped)."""
    tiles_m = -(-problem.m // tiling.tm)
    if problem.op in ("grouped_matmul", "transposed_grouped_matmul"):
        tiles_m += problem.num_groups
    return tiles_m * -(-problem.n // tiling.tn) * -(-problem.k // tiling.tk)
