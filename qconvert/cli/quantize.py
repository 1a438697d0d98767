"""`qconvert quantize`: its flags, the ConvertOptions they make, and the summary it prints."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import click

from qconvert.formats.outside import shown
from qconvert.cli.flag_types import ByteSize, LocalPath, Output, RealNumber, Source, Text, WholeNumber
from qconvert.cli.common import (EXIT_CODES_EPILOG, calibration_options, check_jax_platforms, check_model,
                                 cluster_options, hub_messages, is_leader, join_cluster, note_out, out_path,
                                 print_document, run_with_progress, shard_experts_choice, with_options)
from qconvert.schemes import ALIASES as SCHEME_ALIASES
from qconvert.schemes import NAMES as SCHEME_NAMES


def smoothing_options(command):
    """The smoothing and activation flags of `quantize --scheme w8a8`, after its calibration flags."""
    return calibration_options(with_options(command, [
        click.option("--alpha", type=Text(), default=None, metavar="ALPHA", cls=_AlphaOption),
        click.option("--no-smooth", is_flag=True, default=False,
                     help="Plain W8A8 without smoothing (a baseline)."),
        click.option("--act", type=click.Choice(["dynamic", "static"]), default="dynamic",
                     show_default=True, cls=_RegistryHelp, help_from=_act_help),
        click.option("--act-stats", type=LocalPath(), default=None,
                     help="Reuse activation statistics from `qconvert calibrate` instead of calibrating."),
    ]))



class _AlphaOption(click.Option):
    """--alpha, whose help gives each family's own default alpha (from the family registry, when help is shown)."""

    def get_help_record(self, ctx):
        self.help = ("SmoothQuant migration strength: 'auto' (the default: per group, the grid alpha with the "
                     "least simulated W8A8 output error on calibration rows), 'family' (the family's value: "
                     f"{family_alphas()}), a number in [0, 1], or per group, e.g. "
                     "'0.8,post_attention_layernorm=0.6'. With --act-stats the default is 'family'.")
        return super().get_help_record(ctx)


def family_alphas() -> str:
    """Each default alpha and the families that have it, from the registry: '0.85 Llama/Mistral/..., 0.5 Bert'."""
    from qconvert.models.registry import FAMILIES

    by_alpha: dict[float, list[str]] = {}
    for family in FAMILIES:
        by_alpha.setdefault(family.default_alpha, []).extend(
            name.removesuffix("ForCausalLM").removesuffix("Model") for name in family.hf_architectures)
    return ", ".join(f"{alpha:g} {'/'.join(names)}" for alpha, names in sorted(by_alpha.items(), reverse=True))


def schemes_where(test, joiner: str = " and ") -> str:
    """The names of the registry's schemes that pass `test`, in the registry's order ('int4, int4-asym and
    w4a8-fp8'): what a help text says of a flag, so that a new scheme is named where it belongs."""
    from qconvert.schemes import NAMES, scheme_named

    names = [name for name in NAMES if test(scheme_named(name))]
    return joiner.join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else ""


class _RegistryHelp(click.Option):
    """A flag whose help names schemes: `help_from()` writes it from the scheme registry when help is shown (it
    loads the scheme classes, so not at import)."""

    def __init__(self, *args, help_from, **kwargs):
        self.help_from = help_from
        super().__init__(*args, **kwargs)

    def get_help_record(self, ctx):
        self.help = self.help_from()
        return super().get_help_record(ctx)


def _group_size_help() -> str:
    # A scheme that quantizes its activations as well reads group scales only (W4A8-FP8's vLLM and vLLM TPU
    # methods); a weight-only one also takes one scale per output channel.
    return (f"{schemes_where(lambda s: s.takes_group_size and s.weight_only)}: input columns per weight scale "
            "[default: 128, else the largest of 64 and 32 that divides every quantized linear's input width, else "
            f"channel]. {schemes_where(lambda s: s.takes_group_size and not s.weight_only)}: the same, but never "
            "channel (exit 2), and vLLM on GPU reads group 128 only.")


def _scale_search_help() -> str:
    from qconvert.schemes import SCHEMES

    searched = "; ".join(f"{name} {scheme.clip.what}" for name, scheme in SCHEMES.items())
    default = schemes_where(lambda s: s.default_scale_search)
    return ("Search each scale's clipping ratio c instead of using the plain absmax (same layout, recorded in "
            f"qconvert.json): {searched}. {schemes_where(lambda s: s.calibrates)} judges its candidates on "
            "calibration activations (and searches the static input_scale with --act static), the others on the "
            f"weight's own error. Default: {'on for ' + default if default else 'off for every scheme'} (on real "
            "trained LLMs the clipped scales cost w8a8 perplexity); without it (and GPTQ, AWQ or SmoothQuant) the "
            "scales are the plain absmax, byte-identical to compressed-tensors' and bitsandbytes' round-to-nearest.")


def _gptq_help() -> str:
    return ("Round weights by GPTQ (error-compensated, on each linear's input Hessian from calibration, layer after "
            "layer on the quantized layers' outputs) instead of round-to-nearest; same layout and scales, other "
            f"codes. Default: on for {schemes_where(lambda s: s.default_gptq)} (off with --act-stats and for "
            f"--any-architecture decoders); {schemes_where(lambda s: s.calibrates)} takes it on its calibration "
            "(off by default: it cost real LLMs perplexity after smoothing); "
            f"{schemes_where(lambda s: s.gptq_grid() is not None and not s.default_gptq and not s.calibrates)} "
            "take it with calibration text (--calib, default builtin) and stay byte-identical to round-to-nearest "
            "without it.")


def _awq_help() -> str:
    return ("AWQ: per smoothing group (norm -> q/k/v, v -> o, norm -> gate/up, up -> down; each expert's), search a "
            "per-channel scale on calibration rows (alpha grid 0..0.95, with and without the weights' mean) for the "
            "least output error of the scheme's own rounding, and fold it exactly into the norm or linear before "
            "it; GPTQ then rounds the scaled weights. Same layout; the scales are recorded in qconvert.json and "
            f"verify checks them. Default: on for {schemes_where(lambda s: s.default_awq)} (AWQ then GPTQ: "
            f"docs/ACCURACY.md), off otherwise. Not with {schemes_where(lambda s: s.calibrates, ' or ')} "
            "(SmoothQuant scales those groups) or --act-stats.")


def _kv_cache_help() -> str:
    return ("fp8: calibrate every attention block's keys (after RoPE) and values and write per-tensor FP8 KV-cache "
            "scales (k_scale, v_scale = max|x| / 448) with compressed-tensors' kv_cache_scheme, which vLLM reads "
            f"with --kv-cache-dtype fp8. {schemes_where(lambda s: s.writes_kv_cache_scheme)}; not "
            f"{schemes_where(lambda s: not s.writes_kv_cache_scheme, ' or ')}, --act-stats, encoders or multi-head "
            "latent attention (DeepSeek-V3).")


def _any_architecture_help() -> str:
    return (f"{schemes_where(lambda s: s.weight_only, ', ')} (the weight-only schemes): convert "
            "a decoder of no known family weight-only, taking every 2-D weight under its numbered layers "
            "(model.layers.N.) as a linear. A known family keeps its own list.")


def _double_quant_help() -> str:
    return (f"{schemes_where(lambda s: s.takes_double_quant, ' or ')}: quantize the per-block absmax values too "
            "(bitsandbytes double quantization).")


def _act_help() -> str:
    return (f"{schemes_where(lambda s: 'static' in s.act_modes, ' or ')} activations: per-token scales at run "
            "time, or per-tensor from calibration.")


class _SchemeOption(click.Option):
    """--scheme, whose help lists each scheme's own summary and loaders (read when help is shown)."""

    def get_help_record(self, ctx):
        from qconvert.schemes import DESCRIPTIONS

        self.help = "; ".join(f"{name}: {summary}, loads in {loads_in}"
                              for name, (summary, loads_in) in DESCRIPTIONS.items()) + ". " + (
            "compressed-tensors' preset names are taken too, in any case: "
            + ", ".join(f"{alias} ({name})" for alias, name in SCHEME_ALIASES.items()) + ".")
        return super().get_help_record(ctx)


class _SchemeChoice(click.Choice):
    """The scheme names, and compressed-tensors' preset names (any case) turned into the scheme they name."""

    def convert(self, value, param, ctx):
        from qconvert.schemes import canonical_name

        if isinstance(value, str) and value.upper() in {a.upper() for a in SCHEME_ALIASES}:
            return canonical_name(value)
        return super().convert(value, param, ctx)



def _group_size(ctx, param, value):
    if value is None or value == "channel":
        return value
    if value.strip().isascii() and value.strip().isdigit():
        return int(value)
    raise click.BadParameter(f"{shown(value)!r} is not 32, 64, 128 or channel")



@click.command(epilog=EXIT_CODES_EPILOG)
@click.argument("model", type=Source())
@click.option("-o", "--out", "out", required=True, type=Output(), callback=out_path, metavar="OUT",
              help="Output folder (written beside, then renamed into place).")
@click.option("--scheme", type=_SchemeChoice(SCHEME_NAMES), default="int8", show_default=True, cls=_SchemeOption)
@click.option("--revision", type=Text(), default=None, help="Hub branch, tag or commit (Hub ids only).")
@click.option("--include", type=Text(), multiple=True, metavar="PATTERN",
              help="Also quantize modules matching a glob or re:REGEX (repeatable), e.g. lm_head.")
@click.option("--exclude", type=Text(), multiple=True, metavar="PATTERN",
              help="Keep modules matching a glob or re:REGEX in float (repeatable).")
@click.option("--max-shard-size", type=ByteSize(), default="5GiB", show_default=True, help="Largest shard, e.g. 5GiB, 500MB.")
@click.option("--double-quant", is_flag=True, cls=_RegistryHelp, help_from=_double_quant_help)
@click.option("--group-size", type=Text(), default=None, metavar="32|64|128|channel", callback=_group_size,
              cls=_RegistryHelp, help_from=_group_size_help)
@click.option("--scale-search/--no-scale-search", default=None,
              cls=_RegistryHelp, help_from=_scale_search_help)
@click.option("--gptq/--no-gptq", default=None,
              cls=_RegistryHelp, help_from=_gptq_help)
@click.option("--gptq-damp", type=RealNumber(), default=None, metavar="FRACTION",
              help="GPTQ dampening: this fraction of the mean Hessian diagonal is added to it [default: 0.1].")
@click.option("--gptq-act-order/--no-gptq-act-order", default=None,
              help="GPTQ rounds columns in order of decreasing Hessian diagonal; the scales stay fixed per group "
                   "(static groups), so no permutation is written [default: on].")
@click.option("--awq/--no-awq", default=None,
              cls=_RegistryHelp, help_from=_awq_help)
@click.option("--kv-cache", type=click.Choice(["none", "fp8"]), default="none", show_default=True,
              cls=_RegistryHelp, help_from=_kv_cache_help)
@click.option("--workers", type=WholeNumber(1, 10**12), default=None,
              help="Threads reading and quantizing ahead of the writer [default: one per core; at most 4 per "
                   "core]; same output bytes.")
@click.option("--overwrite", is_flag=True,
              help="Replace OUT if it is an empty folder or one qconvert wrote (its qconvert.json lists every "
                   "file in it); anything else is never replaced.")
@click.option("--dry-run", is_flag=True, help="List what would be quantized and the expected size; write nothing.")
@click.option("--upload-repo", type=Text(empty=True), default=None, metavar="OWNER/NAME",
              help="Once OUT is written, upload it (every file, the model card included) to this Hugging Face Hub "
                   "model repository in one commit, creating it if missing. Needs a token (HF_TOKEN or `hf auth "
                   "login`), checked before converting; a failed upload leaves OUT written and says how to retry.")
@click.option("--public", is_flag=True,
              help="With --upload-repo: create the repository public (default: private; an existing public one is "
                   "refused without --public).")
@click.option("--any-architecture", is_flag=True,
              cls=_RegistryHelp, help_from=_any_architecture_help)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable summary on stdout.")
@click.option("--verbose", is_flag=True,
              help="Also show huggingface_hub's own messages (retries, warnings) on stderr, and after the summary "
                   "what vLLM TPU loads instead where it is recorded refusing the scheme.")
@smoothing_options
@cluster_options
def quantize(model: str, out: Path, upload_repo: str | None, public: bool, quiet: bool, as_json: bool,
             verbose: bool, **flags) -> int:
    """Quantize MODEL (a local folder or a Hugging Face Hub id) into OUT.

    MODEL is a float checkpoint, or one shipped in FP8 (block FP8 with weight_scale_inv, DeepSeek/Qwen3 -FP8
    style; compressed-tensors float-quantized), read as bfloat16 as it streams; other quantized checkpoints
    are refused (exit 5).
    """
    started = time.perf_counter()
    note_out(out)
    hub_messages(verbose)
    join_cluster(flags)
    check_model(model)
    from qconvert.write.upload import check_upload

    upload = check_upload(upload_repo, public) if is_leader() else None  # process 0 writes OUT and uploads it
    check_jax_platforms()
    from qconvert.convert import convert

    options = _convert_options(flags, upload_repo)
    result = run_with_progress(
        lambda stages, progress: convert(model, out, options, progress=progress, message=stages),
        silent=quiet or as_json or not is_leader(), write_bar=not options.dry_run)
    if upload is not None and result.refusal is None:
        result = _uploaded(result, out, upload, silent=quiet or as_json, verbose=verbose)
    # The whole command, imports and model resolution included, not only the conversion.
    result = dataclasses.replace(result, seconds=time.perf_counter() - started)
    if is_leader():  # one of several processes: process 0 speaks for the run
        _print_result(result, quiet, as_json, verbose)
    if result.refusal is not None:  # a dry run lists first, then refuses as the real run would
        raise result.refusal
    return 0



def _convert_options(flags: dict, upload_repo: str | None):
    """The ConvertOptions of the command's flags (validated there)."""
    from qconvert.options import ConvertOptions

    kv_cache = flags["kv_cache"]
    return ConvertOptions(
        scheme=flags["scheme"], revision=flags["revision"], include=flags["include"], exclude=flags["exclude"],
        max_shard_size=flags["max_shard_size"], double_quant=flags["double_quant"],
        group_size=flags["group_size"], scale_search=flags["scale_search"], overwrite=flags["overwrite"],
        dry_run=flags["dry_run"], act=flags["act"], any_architecture=flags["any_architecture"],
        workers=flags["workers"], calibration=_calibration_options_from(flags["scheme"], flags),
        gptq=flags["gptq"], gptq_damp=flags["gptq_damp"], gptq_act_order=flags["gptq_act_order"],
        awq=flags["awq"], kv_cache=None if kv_cache == "none" else kv_cache,
        card_repo=upload_repo if upload_repo and "/" in upload_repo else None)


def _uploaded(result, out: Path, target, silent: bool, verbose: bool):
    """The result with --upload-repo's commit of OUT and its seconds (a dry run: where it would go)."""
    import sys

    from qconvert import __version__
    from qconvert.write.upload import Upload, upload_folder

    if result.dry_run:
        return dataclasses.replace(result, upload=Upload(target.repo, target.private))
    started = time.perf_counter()
    upload = run_with_progress(lambda stages, _: upload_folder(
        out, target, f"Upload the {result.scheme} checkpoint (qconvert {__version__})", message=stages,
        progress_bars=not silent and (verbose or sys.stderr.isatty())), silent=silent)
    return dataclasses.replace(result, upload=upload,
                               phases=(*result.phases, ("uploaded", time.perf_counter() - started)))



def _calibration_options_from(scheme: str, flags: dict):
    """The CalibrationOptions of a calibrating scheme; for another None, or the flags given (ConvertOptions refuses them)."""
    from qconvert.calibration.data import DEFAULT_SAMPLES, DEFAULT_SEQLEN
    from qconvert.options import CalibrationOptions
    from qconvert.schemes import scheme_named

    if not scheme_named(scheme).calibrates and flags["act"] == "dynamic" and all(
            flags[k] in (None, False) for k in ("calib", "calib_samples", "calib_seqlen", "calib_split",
                                                "calib_column", "calib_config", "alpha", "no_smooth", "act_stats",
                                                "shard_experts")):
        return None
    return CalibrationOptions(calib=flags["calib"], calib_samples=flags["calib_samples"] or DEFAULT_SAMPLES,
                       calib_seqlen=flags["calib_seqlen"] or DEFAULT_SEQLEN, calib_split=flags["calib_split"],
                       calib_column=flags["calib_column"], calib_config=flags["calib_config"], alpha=flags["alpha"],
                       smooth=not flags["no_smooth"], act_stats=flags["act_stats"],
                       shard_experts=shard_experts_choice(flags["shard_experts"]))



def _print_result(result, quiet: bool, as_json: bool, verbose: bool = False) -> None:
    from qconvert.cli.console import print_convert_result, stdout_console

    if as_json:
        refusal = result.refusal
        print_document("quantize", result.summary(), *((refusal.exit_code, str(refusal)) if refusal else ()))
    elif not quiet:
        print_convert_result(result, stdout_console())
        for note in result.notes:  # with the summary on stdout: they describe the folder written
            click.echo(f"note: {note}")
        if verbose and result.server_note:  # for TPU users; noise for the rest
            click.echo(f"note: {result.server_note}")

