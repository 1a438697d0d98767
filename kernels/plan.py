"""Kernel selection: describe a matmul problem, get back the kernel plan that will run it.

A plan names the kernel, the backend it runs on, its tiling (from TILE_TABLES,
one table per backend and M regime, named in the plan) and its numerical
guarantee; when no kernel takes the problem it names the pure-jnp reference and
says why (a fallback is never silent).

Backends: "tpu" (Mosaic) and "gpu" (Triton) compile the Pallas kernels; "cpu"
runs the TPU kernels in TPU interpret mode (exact but slow: for kernel work);
"xla" runs each kernel's contract as XLA computes it: the functions of
reference.py themselves, compiled once per shape, so bit-identical to the
reference (int8 x int8 -> int32 dot for W8A8, E4M3 codes cast exactly to float32
for FP8 W8A8, the same NF4 decode, int8 codes cast to the activation dtype for
W8A16, the same int4 dequantize for W4A16).
"auto" picks tpu or gpu where JAX runs on one, and xla on a CPU host.
"reference" names the same code as an explicit fallback.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qconvert.formats.qarray import NF4_BLOCK_SIZE, QKind
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.tiles import FLOAT, RHS_KINDS, Tiling, round_up

OPS = ("int8_matmul", "fp8_matmul", "int8_weight_matmul", "nf4_matmul", "int4_weight_matmul", "grouped_matmul",
       "transposed_grouped_matmul")
BACKENDS = ("auto", "tpu", "gpu", "cpu", "xla", "reference")

# int4 group sizes the kernels decode (or one scale per output channel): a K tile holds whole groups.
INT4_GROUP_SIZES = (32, 64, 128, 256)
# TPU interpret mode simulates every grid step in Python-driven XLA code; past this
# many steps the XLA reference is the only sensible way to get an answer on CPU.
CPU_INTERPRET_MAX_STEPS = 256

GUARANTEES = {
    "int8_matmul": ("exact int32 accumulation, then float32 rescale acc * x_scale[m] * w_scale[n] + bias[n] "
                    "and one cast; bit-identical to the reference and deterministic (no atomics, fixed order)"),
    "fp8_matmul": ("E4M3 x E4M3 products (exact in float32; the TPU kernel upcasts the fp8 tiles to bf16, "
                   "exactly, the GPU kernel runs Triton's native fp8 dot), float32 accumulation, then "
                   "acc * x_scale[m] * w_scale[n] + bias[n] and one cast; matches the reference within float32 "
                   "summation-order error on CPU and TPU, and within 2.1e-4 of the largest output on an H200, "
                   "whose fp8 MMA sums with fewer bits than float32"),
    "int8_weight_matmul": ("int8 codes cast exactly to the activation dtype, float32 accumulation, "
                           "then * w_scale[n] + bias[n]; matches the reference within float32 summation-order error"),
    "nf4_matmul": ("codes decoded with the exact 16-level NF4 table times the block absmax (float32, then the "
                   "activation dtype), float32 accumulation; matches the reference within float32 summation-order error"),
    "int4_weight_matmul": ("int4 codes sign-extended from their nibbles, times their group's scale in float32, "
                           "cast to the activation dtype, float32 accumulation, then + bias[n]; matches the "
                           "reference within float32 summation-order error"),
    "grouped_matmul": ("per-group float32 accumulation (int8 or fp8 rhs: exact codes, per-channel scale after the sum; "
                       "NF4 rhs: exact table decode; int4 rhs: code times group scale, cast to the activation "
                       "dtype); matches the reference within float32 summation-order error"),
    "transposed_grouped_matmul": ("per-group float32 accumulation over the group's rows; empty groups give zeros; "
                                  "matches the reference within float32 summation-order error"),
}


@dataclasses.dataclass(frozen=True)
class KernelProblem:
    """What is to be multiplied: the operation, its sizes and dtypes.

    m, k, n are the logical sizes of y[m, n] = x[m, k] . w[n, k] (for the grouped
    forms: lhs rows, contraction and output columns). rhs_kind is the grouped rhs'
    encoding, a QKind (or its name: "float", "int8", "nf4", "int4"); group_size
    is the int4 weight's input columns per scale (None: one scale per output channel).
    """

    op: str
    m: int
    k: int
    n: int
    x_dtype: str = "float32"
    out_dtype: str = "float32"
    blocksize: int = NF4_BLOCK_SIZE
    num_groups: int = 1
    rhs_kind: QKind = FLOAT
    group_size: int | None = None

    def __post_init__(self):
        # A name given is taken as its kind; an unknown one stays for select_kernel to refuse by name.
        object.__setattr__(self, "rhs_kind", RHS_KINDS.get(self.rhs_kind, self.rhs_kind))


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The chosen kernel: name, backend, tiling, guarantee, and why it fell back (None if it did not)."""

    op: str
    name: str
    backend: str
    tiling: Tiling | None
    guarantee: str
    interpret: bool = False
    fallback_reason: str | None = None
    tile_table: str | None = None

    @property
    def is_reference(self) -> bool:
        """Whether reference.py's code runs: as a fallback ("reference") or as the CPU path ("xla")."""
        return self.backend in ("reference", "xla")

    @property
    def is_pallas(self) -> bool:
        """Whether a Pallas kernel runs (compiled, or interpreted on backend "cpu")."""
        return not self.is_reference

    def describe(self) -> str:
        """One line for reports: kernel, backend, tiling, and the fallback reason if any."""
        mode = " (interpret)" if self.interpret else ""
        text = f"{self.name} on {self.backend}{mode}"
        if self.tiling is not None:
            text += f" [{self.tiling}; {self.tile_table or 'requested'} tiles]"
        if self.fallback_reason:
            text += f"; fell back: {self.fallback_reason}"
        return text


def platform() -> str:
    """The kind of device JAX runs on: "tpu", "gpu" (CUDA or ROCm) or "cpu"."""
    name = jax.default_backend()
    return "gpu" if name in ("gpu", "cuda", "rocm") else name


def resolve_backend(backend: str) -> str:
    """'auto' -> the platform's kernels (tpu, gpu), or 'xla' on a CPU host; other names are checked and kept."""
    if backend not in BACKENDS:
        raise KernelArgumentError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if platform() in ("tpu", "gpu"):
        return platform()
    # On CPU Pallas only interprets; XLA's own int8 and float dots run the same contract far faster.
    return "xla"


def _decodes_nf4(problem: KernelProblem) -> bool:
    """Whether the kernel for the problem decodes NF4 weights (which constrains its K tiling)."""
    return problem.op == "nf4_matmul" or (problem.op == "grouped_matmul" and problem.rhs_kind.flat_blocks)


def _decodes_int4(problem: KernelProblem) -> bool:
    """Whether the kernel for the problem decodes int4 weights (its K tiles hold whole scale groups)."""
    return problem.op == "int4_weight_matmul" or (problem.op == "grouped_matmul" and problem.rhs_kind.column_groups)


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
# the whole K as NF4's is. Grouped int4 experts step K as the dense int4 kernel.
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
        "grouped_matmul": Tiling(16, 128, 32),
        "transposed_grouped_matmul": Tiling(16, 64, 64),
    },
    ("gpu", "prefill"): {
        "int8_matmul": Tiling(128, 128, 128),
        "fp8_matmul": Tiling(128, 128, 128),
        "int8_weight_matmul": Tiling(128, 64, 128),
        "nf4_matmul": Tiling(128, 128, 128),
        "int4_weight_matmul": Tiling(128, 128, 128),
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
        "grouped_matmul": Tiling(16, 512, 256),
        "transposed_grouped_matmul": Tiling(256, 256, 256),
    },
    ("tpu", "prefill"): {
        "int8_matmul": Tiling(256, 512, 256),
        "fp8_matmul": Tiling(256, 512, 256),
        "int8_weight_matmul": Tiling(256, 512, 256),
        "nf4_matmul": Tiling(256, NF4_TPU_MAX_TK, 256),
        "int4_weight_matmul": Tiling(256, 2048, 256),
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
    nf4, int4 = _decodes_nf4(problem), _decodes_int4(problem)
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
    nf4, int4 = _decodes_nf4(problem), _decodes_int4(problem)
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


def _xla_plan(problem: KernelProblem) -> KernelPlan:
    return KernelPlan(problem.op, f"{problem.op}_xla", "xla", None,
                      "the contract as XLA computes it (reference.py's code, jitted): bit-identical to the reference")


def _reference_plan(problem: KernelProblem, reason: str | None) -> KernelPlan:
    return KernelPlan(problem.op, f"{problem.op}_reference", "reference", None, GUARANTEES[problem.op],
                      fallback_reason=reason)


def _fallback_reason(problem: KernelProblem) -> str | None:
    if _decodes_int4(problem) and problem.group_size is not None:
        if problem.group_size not in INT4_GROUP_SIZES:
            sizes = ", ".join(str(g) for g in INT4_GROUP_SIZES)
            return (f"the int4 kernels decode groups of {sizes} input columns (or one scale per channel), "
                    f"not {problem.group_size}")
        if problem.k % problem.group_size:
            return f"K={problem.k} is not a multiple of the int4 group size {problem.group_size}"
    nf4 = _decodes_nf4(problem)
    if nf4 and problem.blocksize != NF4_BLOCK_SIZE:
        return f"the NF4 kernels decode blocks of {NF4_BLOCK_SIZE}, not {problem.blocksize}"
    if nf4 and problem.k % NF4_BLOCK_SIZE:
        return (f"K={problem.k} is not a multiple of the NF4 block size {NF4_BLOCK_SIZE}, so blocks straddle "
                "weight rows and cannot be tiled")
    return None


def select_kernel(problem: KernelProblem, backend: str = "auto", tiling: Tiling | None = None) -> KernelPlan:
    """Choose the kernel for a problem on a backend ('auto', 'tpu', 'gpu', 'cpu', 'xla' or 'reference').

    'cpu' runs the TPU kernel in TPU interpret mode (for tests; slow), unless the
    grid is larger than CPU_INTERPRET_MAX_STEPS, where it falls back to the
    reference and says so. A requested tiling is checked, never silently changed.
    Plans are pure functions of their arguments and cached: an eager call pays
    for planning once per shape.
    """
    if tiling is not None and not isinstance(tiling, Tiling):
        tiling = Tiling(*tiling)
    return _select_kernel(problem, resolve_backend(backend), tiling)


@functools.lru_cache(maxsize=4096)
def _select_kernel(problem: KernelProblem, resolved: str, tiling: Tiling | None) -> KernelPlan:
    if problem.op not in OPS:
        raise KernelArgumentError(f"unknown kernel operation {problem.op!r}; choose one of {', '.join(OPS)}")
    if problem.rhs_kind not in RHS_KINDS:
        raise KernelArgumentError(f"unknown rhs kind {problem.rhs_kind!r}; choose one of {', '.join(map(str, RHS_KINDS))}")
    if min(problem.m, problem.k, problem.n) <= 0:
        raise KernelArgumentError(f"{problem.op} needs non-empty operands, got m={problem.m} k={problem.k} n={problem.n}")
    if resolved == "reference":
        return _reference_plan(problem, None)
    if resolved == "xla":
        return _xla_plan(problem)
    reason = _fallback_reason(problem)
    if reason:
        return _reference_plan(problem, reason)
    kernel_backend = "gpu" if resolved == "gpu" else "tpu"
    table = None
    if tiling is None:
        tiling = default_tiling(problem, kernel_backend)
        table = table_name(kernel_backend, problem)
    else:
        check_tiling(problem, kernel_backend, tiling)
    if resolved == "cpu" and grid_steps(problem, tiling) > CPU_INTERPRET_MAX_STEPS:
        return _reference_plan(problem, (
            f"on CPU the Pallas kernel runs in TPU interpret mode, and {grid_steps(problem, tiling)} grid steps "
            f"(over {CPU_INTERPRET_MAX_STEPS}) would take far too long"))
    name = f"{problem.op}_{'triton' if kernel_backend == 'gpu' else 'mosaic'}"
    return KernelPlan(problem.op, name, resolved, tiling, GUARANTEES[problem.op], interpret=resolved == "cpu",
                      tile_table=table)


def dtype_name(dtype) -> str:
    """Canonical dtype name ('bfloat16', 'float32', ...) for KernelProblem fields."""
    return str(jnp.dtype(dtype))


def plan_result(y, plan: KernelPlan, return_plan: bool):
    """What an entry point returns: y, or (y, plan); an eager interpret-mode call finishes first.

    Interpret mode runs the kernel through host callbacks that dispatch JAX ops
    themselves; letting the caller dispatch more work while they still run can
    deadlock the CPU client, so an eager interpreted call completes before it returns.
    """
    if plan.interpret and not isinstance(y, jax.core.Tracer):
        y.block_until_ready()
    return (y, plan) if return_plan else y
