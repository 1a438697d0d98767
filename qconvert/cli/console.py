"""Terminal rendering for quantize and inspect: the rich progress bar and the summary tables."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from qconvert.convert import ConvertResult
from qconvert.formats.quantized_sources import read_as
from qconvert.inspection import InspectReport


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class RichStages:
    """A bar per stage (calibrating, searching scales, verify's stages) with its count, elapsed time and ETA;
    implements qconvert.progress.Reporter. A finished stage's bar stays, so the run reads as a log."""

    def __init__(self, console: Console):
        self._bars = Progress(
            TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
        )
        self._tasks: dict[str, object] = {}

    def __call__(self, line: str) -> None:
        self._bars.console.print(f"qconvert: {line}", highlight=False, markup=False)

    def step(self, stage: str, done: int, total: int, unit: str = "layers") -> None:
        if stage not in self._tasks:
            self._bars.start()
            self._tasks[stage] = self._bars.add_task(stage, total=total, unit=unit)
        self._bars.update(self._tasks[stage], completed=done, total=total)

    def stop(self) -> None:
        self._bars.stop()


class RichProgress:
    """A bar of input bytes and tensors done, with MB/s; implements qconvert.convert.Progress."""

    def __init__(self, console: Console, stages: RichStages | None = None):
        self._stages = stages  # the earlier stages' bars, closed when writing starts (one live display at a time)
        self._bar = Progress(
            TextColumn("[bold]quantizing"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TextColumn("{task.fields[tensors]} tensors"), TimeRemainingColumn(),
            console=console, transient=True,
        )
        self._task = None
        self._done = self._total = 0

    def start(self, total_bytes: int, total_tensors: int) -> None:
        self._total = total_tensors
        if self._stages is not None:
            self._stages.stop()
        self._bar.start()
        self._task = self._bar.add_task("quantize", total=total_bytes, tensors=f"0/{total_tensors}")

    def advance(self, nbytes: int) -> None:
        self._done += 1
        self._bar.update(self._task, advance=nbytes, tensors=f"{self._done}/{self._total}")

    def stop(self) -> None:
        self._bar.stop()


def print_convert_result(result: ConvertResult, console: Console) -> None:
    """A dry-run table of what would be written, or a one-paragraph summary of what was."""
    if result.dry_run:
        table = Table(title=f"{result.source['model']} -> {result.scheme} (dry run)")
        for column in ("tensor", "kind", "shape", "bytes in", "bytes out"):
            table.add_column(column, justify="right" if column.startswith("bytes") else "left")
        for t in result.tensors:
            table.add_row(t.module or t.source, t.kind, "x".join(map(str, t.shape)),
                          human_bytes(t.source_bytes), human_bytes(t.output_bytes))
        console.print(table)
    if result.weight_only is not None:
        console.print(result.weight_only.describe(), highlight=False)
    verb = "would write" if result.dry_run else f"wrote {result.out}:"
    if result.refusal is not None:
        verb = "would refuse (below); the list is what it would write otherwise:"
    console.print(
        f"{verb} {len(result.quantized_modules)} {result.scheme} linears, "
        f"{sum(t.module is None for t in result.tensors)} tensors unchanged; "
        f"{human_bytes(result.input_bytes)} -> {human_bytes(result.output_bytes)} "
        f"({result.compression_ratio:.2f}x smaller) in {result.seconds:.1f} s{_phases(result)}"
    )
    if result.upload is not None:
        console.print(result.upload.describe(), highlight=False)


def _phases(result: ConvertResult) -> str:
    """' (calibrated in 11.2 s, wrote in 1.0 s)', or nothing for a run of one phase."""
    if len(result.phases) < 2:
        return ""
    return " (" + ", ".join(f"{name} in {seconds:.1f} s" for name, seconds in result.phases) + ")"


def stdout_console() -> Console:
    """The console for tables on stdout: terminal width on a terminal; unbounded in pipes and logs, so
    tensor names are never cut."""
    import sys

    return Console() if sys.stdout.isatty() else Console(width=100_000)


def print_inspect_report(report: InspectReport, console: Console) -> None:
    """The per-tensor table, totals, and the file hash check."""
    table = Table(title=f"{report.folder} ({report.scheme})")
    for column in ("tensor", "kind", "shape", "stored as", "float dtype", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for t in report.tensors:
        table.add_row(t.name, t.kind, "x".join(map(str, t.shape)), t.dtype, t.float_dtype,
                      human_bytes(t.stored_bytes))
    console.print(table)
    quantized, scales = report.quantized_count, report.kv_scale_count
    kv = f", {scales} KV-cache scales" if scales else ""
    console.print(f"{quantized} quantized linears{kv}, {len(report.tensors) - quantized - scales} tensors unchanged; "
                  f"{human_bytes(report.stored_bytes)} stored for {human_bytes(report.float_bytes)} of float "
                  f"weights ({report.compression_ratio:.2f}x)")
    if report.servers:
        console.print("loads in: " + "; ".join(f"{server} {answer}" for server, answer in report.servers.items()))
    if report.record is not None and report.record.source.format is not None:
        source = report.record.source
        console.print(f"converted from {source.model} ({source.format}: {read_as(source.format)})")
    if report.hashes_ok is None:
        console.print("no qconvert.json: file hashes not checked")
    elif report.hashes_ok:
        console.print(f"all {len(report.files)} files match the sha256 in qconvert.json")
    else:
        for f in report.files:
            if not f.ok:
                console.print(f"[red]{f.name}: {'missing' if f.actual is None else 'sha256 differs'}[/red]")
