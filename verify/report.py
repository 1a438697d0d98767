"""verify's outputs: a rich table (worst linears first), a one-line verdict, and the JSON record for CI."""

from __future__ import annotations

import math
import platform
from typing import Any

from qconvert import __version__ as qconvert_version
from qconvert.formats.documents import dumps, envelope
from qconvert.verify.results import LayerResult, VerifyReport
from rich import box
from rich.console import Console
from rich.table import Table



def versions() -> dict[str, str]:
    """Versions of qconvert and of the libraries whose numerics the figures depend on."""
    import jax
    import jaxlib
    import numpy

    from qconvert import __version__

    return {"qconvert": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "numpy": numpy.__version__, "python": platform.python_version()}


def worst_first(layers) -> list[LayerResult]:
    """Layers sorted by SQNR, lowest (worst) first; failing layers lead whatever their SQNR."""
    return sorted(layers, key=lambda r: (r.passed, r.metrics.sqnr_db, r.name))


def verdict(report: VerifyReport) -> str:
    """One line: PASS or FAIL, what was checked, the first failure, and which side failed.

    A fidelity failure (the kernel disagrees with the folder's own arithmetic)
    names the kernel and backend; a quality failure (against the float model)
    says that the kernels and the folder agree, so the quantization itself
    costs that much.
    """
    where = f"{report.scheme} {report.folder}"
    if not report.integrity.passed:
        problems = report.integrity.problems
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return f"FAIL {where}: integrity: {problems[0]}{more}"
    failed = report.failed_checks
    if failed:
        more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
        return f"FAIL {where}: {failed[0].describe()}{more}; {_side(report)}{_against(report)}"
    worst = worst_first(report.layers)
    floor = f"; worst linear {worst[0].name} at {worst[0].metrics.sqnr_db:.1f} dB" if worst else ""
    fidelity = _worst_fidelity(report)
    if fidelity is not None:
        floor += f"; kernels match the folder (fidelity {_db_floor(fidelity.fidelity.sqnr_db)})"
    model = ""
    if report.model is not None:
        m = report.model.metrics
        if report.model.kind == "causal_lm":
            model = f"; KL {m['mean_kl']:.2g}, top-1 {m['top1_agreement']:.1%}, ppl x{m['perplexity_ratio']:.3f}"
        else:
            model = f"; pooled cosine {m['pooled_cosine_mean']:.5f} (mean)"
    skipped = "; whole-model stage skipped" if report.model is None and report.skipped else ""
    return f"PASS {where}: {len(report.layers)} linears{floor}{model}{skipped}{_against(report)}"


def _against(report: VerifyReport) -> str:
    fmt = quantized_reference(report)
    return f"; against a quantized reference ({fmt})" if fmt else ""


def quantized_reference(report: VerifyReport) -> str | None:
    """The format of a reference that is itself quantized (read as float), or None for a float reference."""
    reference = report.reference or {}
    return reference.get("format") if reference.get("quantized") else None


def reference_note(report: VerifyReport) -> str | None:
    """A line saying that the reference is itself quantized, what it is and how it was read (None: float)."""
    fmt = quantized_reference(report)
    if fmt is None:
        return None
    return (f"reference: {report.reference.get('model')} is itself quantized ({fmt}), read with its fp8 weights "
            "dequantized to bfloat16: the figures compare against those, not against the float model it was made "
            "from")


def _worst_fidelity(report: VerifyReport) -> LayerResult | None:
    measured = [r for r in report.layers if r.fidelity is not None]
    return min(measured, key=lambda r: r.fidelity.sqnr_db) if measured else None


def _db_floor(value: float) -> str:
    return "exact" if math.isinf(value) and value > 0 else f">= {value:.0f} dB"


def _side(report: VerifyReport) -> str:
    """Which side failed, in words: the kernel (named, with its backend) or the quantization."""
    if report.failed_fidelity_checks:
        bad = [r for r in report.layers if not r.fidelity_passed]
        kernels = sorted({f"{r.kernel.name} on {r.kernel.backend}" for r in bad})
        return (f"fidelity: kernel {', '.join(kernels)} disagrees with the folder's own dequantized "
                f"weights on {len(bad)} linear(s), a kernel fault, not the quantization")
    if report.failed_quality_checks:
        worst = _worst_fidelity(report)
        agree = (f" (fidelity {_db_floor(worst.fidelity.sqnr_db)} on every layer)" if worst is not None else "")
        return (f"quality: the kernels and the folder agree{agree}; the quantization itself costs "
                "this much against the float model")
    return "check: " + ", ".join(sorted({c.name for c in report.failed_checks}))


def _fmt(value: float, digits: int = 2) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}f}"


def _kernel(r: LayerResult) -> str:
    return r.kernel.name + ("" if r.kernel.fallback_reason is None else " (fallback)")


def linear_table(report: VerifyReport, rows: list[LayerResult], name_width: int) -> Table:
    """The per-linear table of `rows`; the kernel and backend go in the title when every linear ran the same one,
    so that names keep their room (at least `name_width` columns, folded beyond: never cut)."""
    kernels = sorted({(_kernel(r), r.kernel.backend) for r in report.layers})
    per_row = len(kernels) > 1
    where = f"backend {report.backend}" if per_row else f"kernel {kernels[0][0]} on {kernels[0][1]}"
    table = Table(title=f"per linear ({report.scheme}, {where}; SQNR and fidelity in dB)", box=box.SIMPLE_HEAD,
                  show_edge=False, collapse_padding=True)
    table.add_column("linear", min_width=name_width, overflow="fold")
    for col in ("SQNR", "rel err", "cosine", "max err", "fidelity"):
        table.add_column(col, justify="right")
    for col in ("kernel", "backend") if per_row else ():
        table.add_column(col, overflow="fold")
    table.add_column("")
    for r in rows:
        status = "ok" if r.passed else ("[red]FAIL kernel[/red]" if not r.fidelity_passed else "[red]FAIL[/red]")
        kernel = (_kernel(r), r.kernel.backend) if per_row else ()
        table.add_row(r.name, _fmt(r.metrics.sqnr_db), f"{r.metrics.rel_error:.2e}", _fmt(r.metrics.cosine, 6),
                      f"{r.metrics.max_abs_error:.2e}", "-" if r.fidelity is None else _fmt(r.fidelity.sqnr_db, 1),
                      *kernel, status)
    return table


def render(report: VerifyReport, console: Console, *, max_rows: int | None = 20) -> None:
    """Print the per-linear table (worst first), the whole-model figures and the verdict."""
    if report.layers:
        rows = worst_first(report.layers)
        shown = rows if max_rows is None else rows[:max_rows]
        # The figures need about 52 columns; a name takes the rest (folded, never cut, when narrower).
        name_width = max(16, min(max(len(r.name) for r in shown), console.width - 53))
        console.print(linear_table(report, shown, name_width))
        if len(rows) > len(shown):
            console.print(f"... {len(rows) - len(shown)} more linears (all passed)" if all(
                r.passed for r in rows[len(shown):]) else f"... {len(rows) - len(shown)} more linears")
        reasons = sorted({r.kernel.fallback_reason for r in report.layers if r.kernel.fallback_reason})
        for reason in reasons:
            console.print(f"fallback: {reason}")
    note = reference_note(report)
    if note:
        console.print(note, highlight=False, markup=False)
    held_out = report.evaluation.get("held_out")
    if held_out:
        console.print(f"evaluation text: {held_out['evaluation']}; {held_out['note']}", highlight=False, markup=False)
    if report.model is not None:
        m = report.model
        figures = ", ".join(f"{k} {v:.6g}" for k, v in m.metrics.items())
        console.print(f"whole model ({m.kind}, {m.sequences} sequences, {m.tokens} tokens): {figures}")
    for line in report.skipped:
        console.print(f"skipped: {line}", highlight=False, markup=False)
    render_verdict(report, console)


def render_verdict(report: VerifyReport, console: Console) -> None:
    """The verdict, one line whatever the width: a terminal wraps it softly, and `| tail -1` gets it whole."""
    style = "green" if report.passed else "red"
    console.print(verdict(report), style=style, highlight=False, markup=False, soft_wrap=True)


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every CI parser reads the record."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_record(report: VerifyReport) -> dict[str, Any]:
    """The full JSON-ready record: every metric, threshold, version, backend, kernel and tiling."""
    record = {
        **envelope("verify", qconvert_version, exit_code=0 if report.passed else 1, out=str(report.folder)),
        "passed": report.passed,
        "fidelity_passed": report.fidelity_passed,
        "quality_passed": report.quality_passed,
        "verdict": verdict(report),
        "scheme": report.scheme,
        "rounding": report.rounding,
        "reference": report.reference,
        "backend": report.backend,
        "devices": list(report.devices),
        "versions": report.versions,
        "thresholds": report.thresholds.as_dict(),
        "thresholds_given": dict(report.thresholds_given),
        "evaluation": report.evaluation,
        "integrity": report.integrity.as_dict(),
        "layers": [r.as_dict() for r in report.layers],
        "model": report.model.as_dict() if report.model else None,
        "checks": [c.as_dict() for c in report.extra_checks],
        "skipped": list(report.skipped),
        "failures": [c.describe() for c in report.failed_checks] + list(report.integrity.problems),
        "seconds": report.seconds,
    }
    return _finite(record)


def to_json(report: VerifyReport) -> str:
    """to_record as indented, key-sorted JSON text."""
    return dumps(to_record(report))
