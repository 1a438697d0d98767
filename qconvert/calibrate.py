"""`qconvert calibrate`: activation statistics of MODEL on the calibration text, saved to a file that
`quantize --act-stats` reads (formats/act_stats.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qconvert.calibration.data import load_calibration, placed_record
from qconvert.calibration.documents import BUILTIN, check_calibration_source
from qconvert.calibration.hub_dataset import DatasetSelection
from qconvert.cluster.share import agree_settings, same_windows
from qconvert.calibration.observer import DEFAULT_BATCH_SIZE, check_calibration_fits, collect_act_stats
from qconvert.formats.act_stats import ActStats, is_stats_file, write_act_stats
from qconvert.source.resolve import open_source, resolve_source
from qconvert.write.folder import check_file_output_free, check_output_location, check_writable, write_file_atomically


def save_act_stats(path: Path, stats: ActStats, model: str = "", recheck=None) -> None:
    """Write the statistics file (formats/act_stats.py) beside `path` and rename it into place, so a failed
    write never leaves a truncated file; `recheck()` runs just before the rename."""
    write_file_atomically(Path(path), lambda f: write_act_stats(f, stats, model), recheck or (lambda: None))


def check_stats_target(out: Path, overwrite: bool, source: Path | None = None) -> None:
    """`calibrate -o`: quantize's OUT rules for a file (exit 2 for the input, the current folder or a path
    inside the input; exit 8 for an existing OUT unless --overwrite replaces a stats file qconvert wrote)."""
    check_output_location(out, source)
    check_file_output_free(out, overwrite, is_stats_file, "a statistics file")
    check_writable(out.parent, f"the statistics file {out}")


def _resolved_for(model: str, revision: str | None, out: Path, overwrite: bool, writes: bool):
    """MODEL resolved, OUT checked before (against a local folder) and after (against what it resolved to)."""
    if writes:
        check_stats_target(out, overwrite, Path(model) if Path(model).is_dir() else None)  # before any download
    resolved = resolve_source(model, revision)
    if writes:
        check_stats_target(out, overwrite, resolved.folder)
    return resolved


def calibrate_model(model: str, out: Path, *, calib: str | None = None, samples: int = 128,
                    seqlen: int = 512, revision: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                    overwrite: bool = False, message=None,
                    dataset: DatasetSelection | None = None, shard_experts: bool | None = None) -> dict[str, Any]:
    """`qconvert calibrate`: statistics of MODEL (folder or Hub id) on `calib` (of a whole Hub dataset, the part
    `dataset` picks), saved to `out`; a summary.

    OUT is checked before anything is calibrated, and again just before the file
    is renamed into place.
    """
    out = Path(out)
    check_calibration_source(calib, dataset)
    from qconvert.cluster import is_leader
    from qconvert.convert import agree_source

    writes = is_leader()  # of several processes, process 0 writes
    resolved_source = _resolved_for(model, revision, out, overwrite, writes)
    with open_source(resolved_source) as source:  # as `quantize` resolves and opens; closed at the end
        summary = source.summary()
        source.check_weights()
        agree_source(source)  # of several processes, every one reads what process 0 reads
        resolved, params = source.resolved, source.params
        check_calibration_fits(source.model, params, resolved.config, samples, seqlen,
                               shard_experts=shard_experts)  # before any window is made
        data = load_calibration(calib or BUILTIN, resolved.folder, resolved.config, samples=samples, seqlen=seqlen,
                                dataset=dataset)
        agree_settings(same_windows(data.record()), "calibration")  # several processes: the same windows
        if message is not None:
            message(f"calibrating on {data.samples} x {data.seqlen} tokens ({data.description})")
        record = placed_record(data.record(), out)  # the file by name, and where it lies from OUT
        stats = collect_act_stats(source.model, params, data.input_ids, batch_size=batch_size,
                                  shard_experts=shard_experts, calibration=record, progress=message)
    if writes:
        save_act_stats(out, stats, model=resolved.model_id,
                       recheck=lambda: check_stats_target(out, overwrite, resolved.folder))
    return {"out": str(out), "source": summary, "linears": len(stats.act_absmax),
            "calibration": record}
