"""`qconvert verify`: its flags, the report on stdout (or stderr under --json), and the model card's section."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from qconvert.cli.flag_types import LocalPath, RealNumber, Source, Text, WholeNumber
from qconvert.cli.common import (BACKEND_CHOICE, EXIT_CODES_EPILOG, check_jax_platforms, cluster_options,
                                 hub_messages, is_leader, join_cluster, note_out, record_failures,
                                 run_with_progress, verbose_option)
from qconvert.formats.errors import UsageError, require_converted_folder


@click.command(name="verify", epilog=EXIT_CODES_EPILOG,
             short_help="Prove a converted folder: integrity, each quantized linear, the whole model.")
@click.argument("out", type=LocalPath())
@click.option("--reference", type=Source(), default=None, metavar="MODEL",
              help="Float model to compare against (folder or Hub id); default: the source in qconvert.json.")
@click.option("--revision", type=Text(), default=None, help="Hub branch, tag or commit of --reference.")
@click.option("--calib", type=Text(), default="auto", show_default=True, metavar="SOURCE",
              help="Evaluation text: held-out | builtin | random | FILE.txt | FILE.jsonl | hf://datasets/...; "
                   "auto = text calibration did not read: qconvert's held-out prose, or random ids from "
                   "another seed after random calibration or when the reference has no tokenizer. Text "
                   "that shares a run of 16 tokens with the calibration text is refused.")
@click.option("--samples", type=WholeNumber(1, 10**12), default=None, help="Evaluation sequences (default 8; 2 with --quick).")
@click.option("--seqlen", type=WholeNumber(2, 10**12), default=None, help="Tokens per sequence (default 64; 32 with --quick).")
@click.option("--quick", is_flag=True, help="A small evaluation sample: a fast smoke check.")
@click.option("--backend", type=BACKEND_CHOICE, default="auto", show_default=True,
              help="Kernel backend; auto: tpu or gpu kernels, xla on a CPU host; cpu runs the TPU kernels in "
                   "interpret mode.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the full record as JSON on stdout (also when a check fails or the input is bad); the "
                   "table then goes to stderr.")
@click.option("--json-file", "json_file", type=LocalPath(), default=None, metavar="FILE",
              help="Also write the full record as JSON to FILE.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no table: the verdict line only.")
@click.option("--update-card", is_flag=True,
              help="Write the verdict and figures into OUT/README.md (the model card) and its sha256 into "
                   "qconvert.json; not when integrity fails.")
@click.option("--strict", is_flag=True, help="Also fail when a layer fell back from the Pallas kernel to the reference.")
@click.option("--min-sqnr", type=RealNumber(), default=None, metavar="DB", help="Per-layer SQNR floor (dB).")
@click.option("--min-cosine", type=RealNumber(-1.0, 1.0), default=None, help="Per-layer cosine similarity floor.")
@click.option("--min-fidelity-sqnr", type=RealNumber(), default=None, metavar="DB",
              help="Per-layer floor (dB) of the kernel against the folder's own dequantized weights.")
@click.option("--max-kl", type=RealNumber(0.0), default=None, help="Whole-model mean next-token KL ceiling (nats).")
@click.option("--min-top1", type=RealNumber(0.0, 1.0), default=None, help="Whole-model top-1 agreement floor (0..1).")
@click.option("--max-ppl-ratio", type=RealNumber(0.0), default=None, help="Quantized/float perplexity ceiling.")
@click.option("--min-pooled-cosine", type=RealNumber(-1.0, 1.0), default=None,
              help="Encoders: floor of the mean pooled-output cosine over the sequences.")
@verbose_option
@cluster_options
def verify_command(out: Path, reference: str | None, revision: str | None, calib: str, samples: int | None,
                   seqlen: int | None, quick: bool, backend: str, as_json: bool, json_file: Path | None, quiet: bool,
                   update_card: bool, strict: bool, min_sqnr: float | None, min_cosine: float | None, min_fidelity_sqnr: float | None,
                   max_kl: float | None,
                   min_top1: float | None, max_ppl_ratio: float | None,
                   min_pooled_cosine: float | None, verbose: bool, **cluster_flags) -> int:
    """Prove a converted folder: hashes, then every quantized linear and the whole model through the kernels.

    Per layer, fidelity (the kernel against the folder's own dequantized
    weights: only a wrong kernel fails it) and quality (against the float layer:
    what the quantization costs). Exits 0 when every check passes, 1 when any
    fails (integrity, fidelity or quality), and on bad input the code every command gives that input
    (2 usage, 3 a missing folder, 4 an unreachable Hub, 6 an invalid folder...).
    """
    note_out(out)
    hub_messages(verbose)
    if json_file is not None:
        _check_json_target(json_file, out)  # before the check runs, not after
        record_failures("verify", lambda text: _emit_json(text, False, json_file))
    require_converted_folder(out)  # before the readers, and JAX, are imported
    if update_card:
        _check_card_writable(out)
    join_cluster(cluster_flags)
    check_jax_platforms()
    from qconvert.verify.run import VerifyOptions

    thresholds = {"min_layer_sqnr_db": min_sqnr, "min_layer_cosine": min_cosine,
                  "min_fidelity_sqnr_db": min_fidelity_sqnr, "max_mean_kl": max_kl,
                  "min_top1_agreement": min_top1, "max_perplexity_ratio": max_ppl_ratio,
                  "min_pooled_cosine": min_pooled_cosine}
    options = VerifyOptions(reference=reference, revision=revision, calib=calib, samples=samples, seqlen=seqlen,
                            quick=quick, backend=backend, strict=strict, thresholds=thresholds)
    report = _run_verify(out, options, as_json, quiet or not is_leader())
    if not is_leader():  # one of several processes: process 0 reports and writes for the run
        return 0 if report.passed else 1
    _show_verify_report(report, as_json, json_file, quiet)
    if update_card:
        _update_card(out, report, quiet)
    return 0 if report.passed else 1


def _check_card_writable(out: Path) -> None:
    """verify --update-card: the folder must take the card's verification section, known before the check runs."""
    if out.is_dir():
        from qconvert.write.folder import check_writable
        from qconvert.write.replaceable import check_replaceable

        check_writable(out, "the model card's verification section")
        for name in ("README.md", "qconvert.json"):  # both replaced by a rename
            check_replaceable(out / name, "the model card's verification section")


def _update_card(out: Path, report, quiet: bool) -> None:
    """verify --update-card: the verdict into the card, unless the folder's own files failed their check."""
    from qconvert.write.card import CARD_NAME, update_card
    from qconvert.verify.report import to_record

    if not report.integrity.passed:
        click.echo(f"qconvert: {out / CARD_NAME} not updated: the folder failed its integrity check", err=True)
        return
    update_card(out, to_record(report))
    if not quiet:
        click.echo(f"qconvert: wrote the verification section of {out / CARD_NAME}", err=True)



def _run_verify(out: Path, options, as_json: bool, quiet: bool):
    """verify_folder with progress on stderr. Bad input fails as every command's does (its own exit code; the
    error document on stdout and in --json-file); a file that is not what its format says is an invalid folder."""
    from qconvert.formats.errors import FormatError, InvalidCheckpointError
    from qconvert.verify.run import verify_folder

    try:
        return run_with_progress(lambda stages, _: verify_folder(out, options, progress=stages),
                                  silent=quiet or as_json)
    except FormatError as err:
        raise InvalidCheckpointError(str(err)) from None



def _show_verify_report(report, as_json: bool, json_file: Path | None, quiet: bool) -> None:
    """The table and verdict (stderr under --json), then the JSON on stdout and/or in the file."""
    from rich.console import Console

    from qconvert.verify.report import render, render_verdict, to_json

    stream = sys.stderr if as_json else sys.stdout
    # Not a terminal (a pipe, a CI log): no width limit, so names are whole and the verdict stays one line.
    console = Console(stderr=as_json, width=None if stream.isatty() else 100_000)
    if quiet:
        render_verdict(report, console)
    else:
        render(report, console)
    _emit_json(to_json(report), as_json, json_file)



def _emit_json(text: str, as_json: bool, json_file: Path | None) -> None:
    if as_json:
        click.echo(text)
    if json_file is not None:
        from qconvert.write.folder import write_file_atomically

        # Beside, then renamed over; only over a verify record (checked again just before the rename).
        write_file_atomically(json_file, lambda f: f.write((text + "\n").encode("utf-8")),
                              lambda: _check_json_file_free(json_file))



def is_verify_record(path: Path) -> bool:
    """Whether a file is a JSON record `verify --json`/`--json-file` wrote (a format version and a verdict)."""
    import json

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "format_version" in record and "verdict" in record


def _check_json_target(path: Path, folder: Path) -> None:
    """--json-file follows every file qconvert writes on request: never inside the folder verified (exit 2),
    never over a file that is not a verify record qconvert wrote (exit 8)."""
    if not path.parent.is_dir():
        raise UsageError(f"--json-file {path}: the folder {path.parent} does not exist; create it or choose "
                         "another path")
    if path.is_dir():
        raise UsageError(f"--json-file {path} is a folder; give a file name")
    real, verified = path.resolve(), Path(folder).resolve()
    if verified in real.parents:
        raise UsageError(f"--json-file {path} lies inside the folder verified ({folder}); write it elsewhere")
    _check_json_file_free(path)
    from qconvert.write.folder import check_writable

    check_writable(path.parent, f"--json-file {path}")
    from qconvert.write.replaceable import check_replaceable

    check_replaceable(path, f"--json-file {path}")


def _check_json_file_free(path: Path) -> None:
    from qconvert.formats.errors import OutputExistsError

    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise OutputExistsError(f"--json-file {path} exists and is not a file; choose another path")
    if path.exists() and not is_verify_record(path):
        raise OutputExistsError(f"--json-file {path} exists and is not a verify record qconvert wrote; it is never "
                                "replaced: choose another path")

