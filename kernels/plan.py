"""Kernel selection: describe a matmul problem, get back the kernel plan that will run it.

A plan names the kernel, the backend it runs on, its tiling (from tile_tables.TILE_TABLES,
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
from qconvert.kernels.backends import BACKENDS
from qconvert.kernels.errors import KernelArgumentError
from qconvert.kernels.gpu_tuning import GROUPED_VARIANTS, VARIANT_OPS, Variant, tuned_choice
from qconvert.kernels.tile_tables import check_tiling, decodes_int4, decodes_nf4, default_tiling, grid_steps, table_name
from qconvert.kernels.tiles import FLOAT, RHS_KINDS, Tiling, decodes_e2m1

OPS = ("int8_matmul", "fp8_matmul", "int8_weight_matmul", "nf4_matmul", "int4_weight_matmul", "fp4_weight_matmul",
       "grouped_matmul", "transposed_grouped_matmul")

# int4 group sizes the kernels decode (or one scale per output channel): a K tile holds whole groups.
INT4_GROUP_SIZES = (32, 64, 128, 256)
# FP4 group sizes the kernels decode: NVFP4's 16 and MXFP4's 32 input columns per scale.
FP4_GROUP_SIZES = (16, 32)
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
    "fp4_weight_matmul": ("E2M1 codes decoded with the exact 16-value table, times their group's scale (over the "
                          "tensor's global scale, the quotient in float32) in float32, cast to the activation "
                          "dtype, float32 accumulation, then + bias[n]; matches the reference within float32 "
                          "summation-order error"),
    "grouped_matmul": ("per-group float32 accumulation (int8 or fp8 rhs: exact codes, per-channel scale after the sum; "
                       "NF4 rhs: exact table decode; int4 rhs: code times group scale, cast to the activation "
                       "dtype; FP4 rhs: exact E2M1 table decode times group scale over the expert's global scale, "
                       "the quotient in float32, cast to the activation dtype); matches the reference within "
                       "float32 summation-order error"),
    "transposed_grouped_matmul": ("per-group float32 accumulation over the group's rows; empty groups give zeros; "
                                  "matches the reference within float32 summation-order error"),
}


@dataclasses.dataclass(frozen=True)
class KernelProblem:
    """What is to be multiplied: the operation, its sizes and dtypes.

    m, k, n are the logical sizes of y[m, n] = x[m, k] . w[n, k] (for the grouped
    forms: lhs rows, contraction and output columns). rhs_kind is the grouped rhs'
    encoding, a QKind (or its name: "float", "int8", "nf4", "int4", "fp8", "fp4"); group_size
    is the int4 or FP4 weight's input columns per scale (None: one scale per output channel).
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
    variant: Variant | None = None  # a GPU kernel variant (gpu_tuning); None: the tiled kernel

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
        if self.variant is not None:
            text += f" variant {self.variant}"
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


def _xla_plan(problem: KernelProblem) -> KernelPlan:
    return KernelPlan(problem.op, f"{problem.op}_xla", "xla", None,
                      "the contract as XLA computes it (reference.py's code, jitted): bit-identical to the reference")


def _reference_plan(problem: KernelProblem, reason: str | None) -> KernelPlan:
    return KernelPlan(problem.op, f"{problem.op}_reference", "reference", None, GUARANTEES[problem.op],
                      fallback_reason=reason)


def _fallback_reason(problem: KernelProblem) -> str | None:
    if problem.op == "fp4_weight_matmul" or (problem.op == "grouped_matmul" and decodes_e2m1(problem.rhs_kind)):
        if problem.group_size not in FP4_GROUP_SIZES:
            return (f"the FP4 kernels decode groups of {' or '.join(map(str, FP4_GROUP_SIZES))} input columns, "
                    f"not {problem.group_size}")
        if problem.k % problem.group_size:
            return f"K={problem.k} is not a multiple of the FP4 group size {problem.group_size}"
        return None
    if decodes_int4(problem) and problem.group_size is not None:
        if problem.group_size not in INT4_GROUP_SIZES:
            sizes = ", ".join(str(g) for g in INT4_GROUP_SIZES)
            return (f"the int4 kernels decode groups of {sizes} input columns (or one scale per channel), "
                    f"not {problem.group_size}")
        if problem.k % problem.group_size:
            return f"K={problem.k} is not a multiple of the int4 group size {problem.group_size}"
    nf4 = decodes_nf4(problem)
    if nf4 and problem.blocksize != NF4_BLOCK_SIZE:
        return f"the NF4 kernels decode blocks of {NF4_BLOCK_SIZE}, not {problem.blocksize}"
    if nf4 and problem.k % NF4_BLOCK_SIZE:
        return (f"K={problem.k} is not a multiple of the NF4 block size {NF4_BLOCK_SIZE}, so blocks straddle "
                "weight rows and cannot be tiled")
    return None


def select_kernel(problem: KernelProblem, backend: str = "auto", tiling: Tiling | None = None,
                  variant: Variant | None = None) -> KernelPlan:
    """Choose the kernel for a problem on a backend ('auto', 'tpu', 'gpu', 'cpu', 'xla' or 'reference').

    'cpu' runs the TPU kernel in TPU interpret mode (for tests; slow), unless the
    grid is larger than CPU_INTERPRET_MAX_STEPS, where it falls back to the
    reference and says so. A requested tiling is checked, never silently changed.
    Plans are pure functions of their arguments and cached: an eager call pays
    for planning once per shape. On "gpu" a dense problem takes the variant and
    tiling the tuned table (gpu_tuning) holds for its shape, unless a tiling or a
    variant is requested; a requested variant runs on "gpu" only.
    """
    if tiling is not None and not isinstance(tiling, Tiling):
        tiling = Tiling(*tiling)
    resolved = resolve_backend(backend)
    grouped = problem.op == "grouped_matmul" and (variant is None or variant.name in GROUPED_VARIANTS)
    if variant is not None and (resolved != "gpu" or not (problem.op in VARIANT_OPS or grouped)):
        raise KernelArgumentError(f"kernel variants run on backend 'gpu' for {', '.join(VARIANT_OPS)} (and "
                                  f"{' or '.join(GROUPED_VARIANTS)} for grouped_matmul); got variant "
                                  f"{variant.name!r} for {problem.op} on {resolved!r}")
    return _select_kernel(problem, resolved, tiling, variant)


@functools.lru_cache(maxsize=4096)
def _select_kernel(problem: KernelProblem, resolved: str, tiling: Tiling | None,
                   variant: Variant | None = None) -> KernelPlan:
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
    if resolved == "gpu" and tiling is None and variant is None and problem.op in VARIANT_OPS + ("grouped_matmul",):
        tuned = tuned_choice(tuned_op(problem), problem.m, problem.k, problem.n)
        if tuned is not None and variant_fits(problem, *tuned):
            variant, tiling = tuned[0], fitted_rows(problem, tuned[1])
            name = f"{problem.op}_{'xla' if variant.name == 'xla' else 'triton'}"
            return KernelPlan(problem.op, name, resolved, tiling, GUARANTEES[problem.op], tile_table="gpu/tuned",
                              variant=variant)
    if tiling is None:
        tiling = default_tiling(problem, kernel_backend)
        table = table_name(kernel_backend, problem)
    else:
        check_tiling(problem, kernel_backend, tiling)
    if variant is not None and not variant_fits(problem, variant, tiling):
        raise KernelArgumentError(f"variant {variant} splits K into {variant.split} ranges, which the "
                                  f"{-(-problem.k // tiling.tk)} K steps of {tiling} do not divide evenly")
    if resolved == "cpu" and grid_steps(problem, tiling) > CPU_INTERPRET_MAX_STEPS:
        return _reference_plan(problem, (
            f"on CPU the Pallas kernel runs in TPU interpret mode, and {grid_steps(problem, tiling)} grid steps "
            f"(over {CPU_INTERPRET_MAX_STEPS}) would take far too long"))
    name = f"{problem.op}_{'triton' if kernel_backend == 'gpu' else 'mosaic'}"
    return KernelPlan(problem.op, name, resolved, tiling, GUARANTEES[problem.op], interpret=resolved == "cpu",
                      tile_table=table, variant=variant)


def tuned_op(problem: KernelProblem) -> str:
    """The operation's name in the tuned table: grouped ones by their rhs kind ("grouped_matmul/nf4")."""
    return f"grouped_matmul/{problem.rhs_kind}" if problem.op == "grouped_matmul" else problem.op


def variant_fits(problem: KernelProblem, variant: Variant, tiling: Tiling) -> bool:
    """Whether a variant can run a problem at a tiling: the tiling passes the GPU rules, and split K ranges
    hold whole K steps."""
    if problem.op == "grouped_matmul" and variant.name not in GROUPED_VARIANTS:
        return False
    try:
        check_tiling(problem, "gpu", tiling)
    except KernelArgumentError:
        return False
    return -(-problem.k // tiling.tk) % variant.split == 0


def fitted_rows(problem: KernelProblem, tiling: Tiling) -> Tiling:
    """A tuned tiling with its row tile cut to the smallest power of two >= 16 that holds M, where smaller."""
    tm = 16
    while tm < min(problem.m, tiling.tm):
        tm *= 2
    return Tiling(min(tm, tiling.tm), tiling.tk, tiling.tn)


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
