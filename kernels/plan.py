"""Kernel selection: describe a matmul problem, get back the kernel plan that will run it.

A plan names the kernel, the backend it runs on, its tiling and its numerical
guarantee; when no kernel takes the problem it names the pure-jnp reference and
says why (a fallback is never silent).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qconvert.errors import KernelArgumentError
from qconvert.kernels.tiles import Tiling, round_up

OPS = ("int8_matmul", "int8_weight_matmul", "nf4_matmul", "grouped_matmul", "transposed_grouped_matmul")
BACKENDS = ("auto", "tpu", "gpu", "cpu", "reference")
RHS_KINDS = ("float", "int8", "nf4")
NF4_BLOCK = 64
# TPU interpret mode simulates every grid step in Python-driven XLA code; past this
# many steps the XLA reference is the only sensible way to get an answer on CPU.
CPU_INTERPRET_MAX_STEPS = 256

GUARANTEES = {
    "int8_matmul": ("exact int32 accumulation, then float32 rescale acc * x_scale[m] * w_scale[n] + bias[n] "
                    "and one cast; bit-identical to the reference and deterministic (no atomics, fixed order)"),
    "int8_weight_matmul": ("int8 codes cast exactly to the activation dtype, float32 accumulation, "
                           "then * w_scale[n] + bias[n]; matches the reference within float32 summation-order error"),
    "nf4_matmul": ("codes decoded with the exact 16-level NF4 table times the block absmax (float32, then the "
                   "activation dtype), float32 accumulation; matches the reference within float32 summation-order error"),
    "grouped_matmul": ("per-group float32 accumulation (int8 rhs: exact codes, per-channel scale after the sum; "
                       "NF4 rhs: exact table decode); matches the reference within float32 summation-order error"),
    "transposed_grouped_matmul": ("per-group float32 accumulation over the group's rows; empty groups give zeros; "
                                  "matches the reference within float32 summation-order error"),
}


@dataclasses.dataclass(frozen=True)
class KernelProblem:
    """What is to be multiplied: the operation, its sizes and dtypes.

    m, k, n are the logical sizes of y[m, n] = x[m, k] . w[n, k] (for the grouped
    forms: lhs rows, contraction and output columns). rhs_kind is the grouped rhs'
    encoding ("float", "int8", "nf4").
    """

    op: str
    m: int
    k: int
    n: int
    x_dtype: str = "float32"
    out_dtype: str = "float32"
    blocksize: int = NF4_BLOCK
    num_groups: int = 1
    rhs_kind: str = "float"


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

    @property
    def is_reference(self) -> bool:
        return self.backend == "reference"

    def describe(self) -> str:
        """One line for reports: kernel, backend, tiling, and the fallback reason if any."""
        mode = " (interpret)" if self.interpret else ""
        text = f"{self.name} on {self.backend}{mode}"
        if self.tiling is not None:
            text += f" [{self.tiling}]"
        if self.fallback_reason:
            text += f"; fell back: {self.fallback_reason}"
        return text


def resolve_backend(backend: str) -> str:
    """'auto' -> the platform JAX runs on (tpu, gpu or cpu); other names are checked and kept."""
    if backend not in BACKENDS:
        raise KernelArgumentError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "cpu"


def _decodes_nf4(problem: KernelProblem) -> bool:
    """Whether the kernel for the problem decodes NF4 weights (which constrains its K tiling)."""
    return problem.op == "nf4_matmul" or (problem.op == "grouped_matmul" and problem.rhs_kind == "nf4")


def _gpu_rows(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def default_tiling(problem: KernelProblem, backend: str) -> Tiling:
    """The tiling a backend uses for a problem when none is asked for.

    TPU (and CPU, which interprets the TPU kernel): blocks aligned to the (8, 128)
    vreg tiling ((32, 128) for int8 rows), at most 256 x 512 x 256 so double-buffered
    tiles stay far below VMEM; NF4 takes the whole K (up to 8192) per tile so its
    per-64-block absmax tile is a full-width block. GPU (Triton): power-of-two
    tiles of at least 16; small M (decode) uses narrow N tiles for more programs.
    """
    m, k, n, op = problem.m, problem.k, problem.n, problem.op
    nf4 = _decodes_nf4(problem)
    if backend == "gpu":
        if op == "transposed_grouped_matmul":
            # M is the contraction here, walked in row chunks; the output tile is tk x tn.
            return Tiling(min(64, _gpu_rows(m)), 64, 64 if n <= 64 else 128)
        tm = _gpu_rows(m)
        tn = 32 if m <= 16 else 64 if m <= 64 else 128
        tk = NF4_BLOCK if nf4 else 128 if op == "int8_matmul" else 64
        return Tiling(tm, tk, tn)
    row_align = 32 if op == "int8_matmul" else 16
    tm = min(256, round_up(m, row_align))
    tn = min(256, round_up(n, 128))
    if op == "transposed_grouped_matmul":
        # There K is the output rows and M the contraction; both are lane/sublane dims.
        return Tiling(min(256, round_up(m, 128)), min(256, round_up(k, 16)), tn)
    if nf4:
        kp = round_up(k, 256)
        return Tiling(tm, kp if kp <= 8192 else 8192, tn)
    return Tiling(tm, min(512, round_up(k, 128)), tn)


def check_tiling(problem: KernelProblem, backend: str, tiling: Tiling) -> None:
    """Raise KernelArgumentError when a requested tiling breaks the backend's layout rules."""
    nf4 = _decodes_nf4(problem)
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    if min(tm, tk, tn) <= 0:
        raise KernelArgumentError(f"tile sizes must be positive, got {tiling}")
    if backend == "gpu":
        if any(t < 16 or t & (t - 1) for t in (tm, tk, tn)):
            raise KernelArgumentError(f"GPU tiles must be powers of two >= 16, got {tiling}")
        if nf4 and tk != NF4_BLOCK:
            raise KernelArgumentError(f"the GPU NF4 kernel steps K one 64-block at a time; use tk=64, got {tk}")
        return
    if problem.op == "transposed_grouped_matmul":
        # lhs [K, M] tiles are (tk, tm): M on lanes, K on sublanes.
        if tm % 128 or tk % 8 or tn % 128:
            raise KernelArgumentError(f"TPU transposed_grouped_matmul tiles need tm % 128, tk % 8 and tn % 128 "
                                      f"to be 0, got {tiling}")
        return
    row_align = 32 if problem.op == "int8_matmul" else 8
    if tm % row_align or tn % 128:
        raise KernelArgumentError(f"TPU tiles need tm % {row_align} == 0 and tn % 128 == 0, got {tiling}")
    if nf4:
        full_k = round_up(problem.k, 256)
        if tk % 256 or (tk != full_k and tk % 8192):
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


def _reference_plan(problem: KernelProblem, reason: str | None) -> KernelPlan:
    return KernelPlan(problem.op, f"{problem.op}_reference", "reference", None, GUARANTEES[problem.op],
                      fallback_reason=reason)


def _fallback_reason(problem: KernelProblem) -> str | None:
    nf4 = _decodes_nf4(problem)
    if nf4 and problem.blocksize != NF4_BLOCK:
        return f"the NF4 kernels decode blocks of {NF4_BLOCK}, not {problem.blocksize}"
    if nf4 and problem.k % NF4_BLOCK:
        return (f"K={problem.k} is not a multiple of the NF4 block size {NF4_BLOCK}, so blocks straddle "
                "weight rows and cannot be tiled")
    return None


def select_kernel(problem: KernelProblem, backend: str = "auto", tiling: Tiling | None = None) -> KernelPlan:
    """Choose the kernel for a problem on a backend ('auto', 'tpu', 'gpu', 'cpu' or 'reference').

    'cpu' runs the TPU kernel in TPU interpret mode (for tests; slow), unless the
    grid is larger than CPU_INTERPRET_MAX_STEPS, where it falls back to the
    reference and says so. A requested tiling is checked, never silently changed.
    """
    if problem.op not in OPS:
        raise KernelArgumentError(f"unknown kernel operation {problem.op!r}; choose one of {', '.join(OPS)}")
    if problem.rhs_kind not in RHS_KINDS:
        raise KernelArgumentError(f"unknown rhs kind {problem.rhs_kind!r}; choose one of {', '.join(RHS_KINDS)}")
    if min(problem.m, problem.k, problem.n) <= 0:
        raise KernelArgumentError(f"{problem.op} needs non-empty operands, got m={problem.m} k={problem.k} n={problem.n}")
    resolved = resolve_backend(backend)
    if resolved == "reference":
        return _reference_plan(problem, None)
    reason = _fallback_reason(problem)
    if reason:
        return _reference_plan(problem, reason)
    kernel_backend = "gpu" if resolved == "gpu" else "tpu"
    if tiling is None:
        tiling = default_tiling(problem, kernel_backend)
    else:
        tiling = Tiling(*tiling) if not isinstance(tiling, Tiling) else tiling
        check_tiling(problem, kernel_backend, tiling)
    if resolved == "cpu" and grid_steps(problem, tiling) > CPU_INTERPRET_MAX_STEPS:
        return _reference_plan(problem, (
            f"on CPU the Pallas kernel runs in TPU interpret mode, and {grid_steps(problem, tiling)} grid steps "
            f"(over {CPU_INTERPRET_MAX_STEPS}) would take far too long"))
    name = f"{problem.op}_{'triton' if kernel_backend == 'gpu' else 'mosaic'}"
    return KernelPlan(problem.op, name, resolved, tiling, GUARANTEES[problem.op], interpret=resolved == "cpu")


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
