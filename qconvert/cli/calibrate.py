"""`qconvert calibrate`: activation statistics of MODEL saved to a file that `quantize --act-stats` reads."""

from __future__ import annotations

from pathlib import Path

import click

from qconvert.cli.flag_types import Output, Source, Text
from qconvert.cli.common import (EXIT_CODES_EPILOG, calibration_options, check_jax_platforms, check_model,
                                 cluster_options, hub_messages, is_leader, join_cluster, note_out, out_path,
                                 print_document, run_with_progress, shard_experts_choice, verbose_option)


@click.command(epilog=EXIT_CODES_EPILOG,
             short_help="Save every linear input's max|x| over calibration text to a file.")
@click.argument("model", type=Source())
@click.option("-o", "--out", "out", required=True, type=Output(), callback=out_path, metavar="OUT",
              help="The statistics file to write (safetensors).")
@click.option("--revision", type=Text(), default=None, help="Hub branch, tag or commit (Hub ids only).")
@calibration_options
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is a statistics file qconvert wrote; anything else is never replaced.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@verbose_option
@cluster_options
def calibrate(model: str, out: Path, revision: str | None, calib: str | None, calib_samples: int | None,
              calib_seqlen: int | None, calib_split: str | None, calib_column: str | None, calib_config: str | None,
              shard_experts: str | None, overwrite: bool, quiet: bool, as_json: bool, verbose: bool,
              **cluster_flags) -> int:
    """Run calibration text through MODEL and save every linear input's max|x| to OUT.

    `qconvert quantize MODEL --scheme w8a8 --act-stats OUT` reuses the file.
    """
    note_out(out)
    hub_messages(verbose)
    join_cluster(cluster_flags)
    check_model(model)
    check_jax_platforms()
    from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
    from qconvert.calibration.hub_dataset import DatasetSelection
    from qconvert.calibrate import calibrate_model

    dataset = DatasetSelection(config=calib_config, split=calib_split, column=calib_column)

    summary = run_with_progress(
        lambda stages, _: calibrate_model(model, out, calib=calib, samples=calib_samples or DEFAULT_SAMPLES,
                                          seqlen=calib_seqlen or DEFAULT_SEQLEN, revision=revision,
                                          overwrite=overwrite, message=stages, dataset=dataset,
                                          shard_experts=shard_experts_choice(shard_experts)),
        silent=quiet or as_json or not is_leader())
    if not is_leader():  # one of several processes: process 0 writes and speaks for the run
        return 0
    if as_json:
        print_document("calibrate", summary)
    elif not quiet:
        click.echo(f"wrote {out}: {summary['linears']} linears, {summary['calibration']['tokens']} tokens "
                   f"({summary['calibration']['description']})")
    return 0

